//! What produced a trace that a report shows: one of mla-diff's paths, or an engine's dump.
//!
//! The engine runs [`PathKind`]s, and only those; a report and the detectors also judge traces
//! that came from outside (`mla-diff compare`). Keeping the two types apart means no runnable-path
//! match has an arm for a dump, while reports keep naming a dump `"dump"`.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::compute::path::PathKind;

/// The source of a judged trace. Orders as the paths in report order, then the dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PathLabel {
    /// One of mla-diff's engine paths.
    Path(PathKind),
    /// An external engine's dump (`mla-diff compare`).
    Dump,
}

impl PathLabel {
    /// Lower-case name (`mha`, `mqa`, `chunked`, `mixed`, `dump`), as reports and JSON write it.
    pub fn name(self) -> &'static str {
        match self {
            PathLabel::Path(p) => p.name(),
            PathLabel::Dump => "dump",
        }
    }

    /// The path, when mla-diff ran one.
    pub fn path(self) -> Option<PathKind> {
        match self {
            PathLabel::Path(p) => Some(p),
            PathLabel::Dump => None,
        }
    }

    /// The label named `name` (see [`PathLabel::name`]).
    pub fn parse(name: &str) -> Option<PathLabel> {
        if name == "dump" {
            return Some(PathLabel::Dump);
        }
        PathKind::ALL
            .iter()
            .copied()
            .find(|p| p.name() == name)
            .map(PathLabel::Path)
    }
}

impl From<PathKind> for PathLabel {
    fn from(p: PathKind) -> PathLabel {
        PathLabel::Path(p)
    }
}

impl PartialEq<PathKind> for PathLabel {
    fn eq(&self, other: &PathKind) -> bool {
        *self == PathLabel::Path(*other)
    }
}

impl std::fmt::Display for PathLabel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for PathLabel {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for PathLabel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        PathLabel::parse(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "unknown path `{name}` (expected mha, mqa, chunked, mixed or dump)"
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_keep_the_names_and_order_reports_use() {
        let all: Vec<PathLabel> = PathKind::ALL
            .iter()
            .map(|&p| p.into())
            .chain([PathLabel::Dump])
            .collect();
        let names: Vec<&str> = all.iter().map(|l| l.name()).collect();
        assert_eq!(names, ["mha", "mqa", "chunked", "mixed", "dump"]);
        let mut sorted = all.clone();
        sorted.sort();
        assert_eq!(sorted, all, "report order: the paths, then the dump");
        for l in all {
            let j = serde_json::to_string(&l).unwrap();
            assert_eq!(j, format!("\"{}\"", l.name()));
            assert_eq!(serde_json::from_str::<PathLabel>(&j).unwrap(), l);
        }
        assert!(serde_json::from_str::<PathLabel>("\"mlp\"").is_err());
        assert_eq!(PathLabel::Dump.path(), None);
        assert_eq!(PathLabel::Path(PathKind::Mqa).path(), Some(PathKind::Mqa));
    }
}
