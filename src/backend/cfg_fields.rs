//! The syntax shared by the fast kernels' launch configurations ([`super::decode_cfg::DecodeCfg`],
//! [`super::prefill_cfg::PrefillCfg`]): a comma list of unsigned integers, either positional (the
//! compact form BENCHMARKS.md's tables use) or named (`heads=16,warps=4,…`, any order, which a
//! reader can check without the field list). docs/kernels.md is the reference for both.

use crate::core::error::Error;

/// `e` (a configuration's parse or rule error, [`Error::Usage`]) read from the environment
/// variable `var`: its message prefixed with `var` (`MLA_DIFF_DECODE_CFG: decode configuration
/// …`); other errors unchanged.
pub fn env_err(var: &str, e: Error) -> Error {
    match e {
        Error::Usage(m) => Error::Usage(format!("{var}: {m}")),
        other => other,
    }
}

/// One field of a configuration string: its name in the named form and its value when left out
/// (`None`: required).
#[derive(Debug, Clone, Copy)]
pub struct Field {
    /// Lower-case name, e.g. `heads`.
    pub name: &'static str,
    /// The value when the field is absent; `None` when it must be given.
    pub default: Option<usize>,
}

impl Field {
    /// A field that must be given.
    pub const fn required(name: &'static str) -> Field {
        Field { name, default: None }
    }

    /// A field taking `default` when left out.
    pub const fn optional(name: &'static str, default: usize) -> Field {
        Field {
            name,
            default: Some(default),
        }
    }
}

/// The values of `fields`, in their order, read from `s`: positional (`16,4,1,0,4`; at least the
/// leading fields without a default, the rest taking their defaults) or named (`heads=16,
/// warps=4`; names case-insensitive, each at most once, absent ones taking their defaults).
///
/// Errors: one line (without the configuration's name, which the caller adds) naming the field
/// that is unknown, repeated, missing, or not an unsigned integer, or saying that the forms are
/// mixed or the count is wrong.
pub fn parse_fields(s: &str, fields: &[Field]) -> Result<Vec<usize>, String> {
    let items: Vec<&str> = s.split(',').map(str::trim).collect();
    let names = || fields.iter().map(|f| f.name).collect::<Vec<_>>().join(", ");
    let named = items.iter().filter(|x| x.contains('=')).count();
    if named == 0 {
        let required = fields.iter().rposition(|f| f.default.is_none()).map_or(0, |i| i + 1);
        if items.len() < required || items.len() > fields.len() {
            return Err(format!(
                "expected {} to {} comma-separated unsigned integers ({}), or name=value pairs; got {}",
                required,
                fields.len(),
                names(),
                items.len()
            ));
        }
        let mut out = Vec::with_capacity(fields.len());
        for (i, f) in fields.iter().enumerate() {
            out.push(match items.get(i) {
                Some(x) => x
                    .parse::<usize>()
                    .map_err(|_| format!("field {} ({}) is `{x}`, not an unsigned integer", i + 1, f.name))?,
                None => f.default.unwrap_or(0),
            });
        }
        return Ok(out);
    }
    if named != items.len() {
        return Err("mixes positional values and name=value pairs: use one form".into());
    }
    let mut got: Vec<Option<usize>> = vec![None; fields.len()];
    for item in items {
        let (name, value) = item.split_once('=').unwrap_or((item, ""));
        let name = name.trim().to_ascii_lowercase();
        let i = fields
            .iter()
            .position(|f| f.name == name)
            .ok_or_else(|| format!("unknown field `{name}` (fields: {})", names()))?;
        if got[i].is_some() {
            return Err(format!("field `{name}` given twice"));
        }
        let value = value.trim();
        got[i] = Some(
            value
                .parse::<usize>()
                .map_err(|_| format!("field `{name}` is `{value}`, not an unsigned integer"))?,
        );
    }
    fields
        .iter()
        .zip(got)
        .map(|(f, v)| v.or(f.default).ok_or_else(|| format!("missing field `{}`", f.name)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: [Field; 3] = [
        Field::required("heads"),
        Field::required("warps"),
        Field::optional("teams", 1),
    ];

    #[test]
    fn positional_and_named_give_the_same_values() {
        assert_eq!(parse_fields("16,4", &F), Ok(vec![16, 4, 1]));
        assert_eq!(parse_fields("16, 4, 2", &F), Ok(vec![16, 4, 2]));
        assert_eq!(parse_fields("warps=4,HEADS=16", &F), Ok(vec![16, 4, 1]));
        assert_eq!(parse_fields("teams=2, heads=16, warps=4", &F), Ok(vec![16, 4, 2]));
    }

    #[test]
    fn every_error_names_the_field_or_the_form() {
        let err = |s: &str| parse_fields(s, &F).unwrap_err();
        assert!(err("16").contains("expected 2 to 3"), "{}", err("16"));
        assert!(err("16,4,1,1").contains("got 4"));
        assert!(err("16,x").contains("field 2 (warps) is `x`"));
        assert!(err("heads=16,warp=4").contains("unknown field `warp` (fields: heads, warps, teams)"));
        assert!(err("heads=16,heads=16").contains("field `heads` given twice"));
        assert!(err("heads=16").contains("missing field `warps`"));
        assert!(err("heads=16,warps=-1").contains("field `warps` is `-1`"));
        assert!(err("16,warps=4").contains("mixes positional"));
    }
}
