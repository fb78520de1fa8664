//! The golden gate: the committed cases pass, and every way a case can go wrong is caught —
//! a 1% edit of one stored value (exit 1, naming the site), a changed GGUF and a missing site
//! (exit 2, never a pass), an overwrite without `--force`.

use std::path::{Path, PathBuf};

use crate::common::{repo, run_bin};

/// Copies case `case` (and, for a file-backed case, its GGUF) into a fresh repository-shaped
/// temporary folder; returns (tempdir guard, its golden folder).
fn copy_case(case: &str) -> (tempfile::TempDir, PathBuf) {
    let src = repo().join("golden");
    let tmp = tempfile::tempdir().unwrap();
    let g = tmp.path().join("golden");
    std::fs::create_dir_all(g.join(case)).unwrap();
    for f in ["manifest.json", "trace.safetensors"] {
        std::fs::copy(src.join(case).join(f), g.join(case).join(f)).unwrap();
    }
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join(case).join("manifest.json")).unwrap()).unwrap();
    let gguf = m["gguf"]["path"].as_str().unwrap().to_string();
    if gguf != "<embedded>" {
        let dst = tmp.path().join(&gguf);
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(repo().join(&gguf), dst).unwrap();
    }
    (tmp, g)
}

/// Offset (in the file) and current value of element `idx` of tensor `name` (F32).
fn locate(path: &Path, name: &str, idx: usize) -> (usize, f32) {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let start = h[name]["data_offsets"][0].as_u64().unwrap() as usize;
    let off = 8 + n + start + 4 * idx;
    (off, f32::from_le_bytes(b[off..off + 4].try_into().unwrap()))
}

fn check(g: &Path, case: &str) -> (i32, String, String) {
    run_bin(&["golden", "check", "--golden-dir", g.to_str().unwrap(), "--case", case])
}

/// The committed cases' names against what `golden/` holds: one case per fixture in
/// `golden/models` (named as the file) plus `embedded-default`. `Err` names every extra case
/// (e.g. one recorded by hand into `./golden`) and every missing one.
fn case_set_problems(g: &Path) -> Result<usize, String> {
    let mut want: Vec<String> = std::fs::read_dir(g.join("models"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    want.push("embedded-default".into());
    let have = mla_diff::jobs::golden::list_cases(g).unwrap();
    let extra: Vec<&String> = have.iter().filter(|c| !want.contains(c)).collect();
    let missing: Vec<&String> = want.iter().filter(|c| !have.contains(c)).collect();
    let mut why = Vec::new();
    if !extra.is_empty() {
        why.push(format!(
            "{} holds case(s) that are not committed fixture cases: {} (recorded by hand? remove them, or record into a temporary --golden-dir)",
            g.display(),
            extra.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(", ")
        ));
    }
    if !missing.is_empty() {
        why.push(format!(
            "{} lacks the case(s) of fixture(s): {} (scripts/fixtures/record_goldens.sh records them)",
            g.display(),
            missing.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(", ")
        ));
    }
    if why.is_empty() {
        Ok(want.len())
    } else {
        Err(why.join("; "))
    }
}

#[test]
fn committed_cases_all_match() {
    let g = repo().join("golden");
    // Every fixture has a case, plus the embedded default, and nothing else.
    let n_cases = case_set_problems(&g).unwrap_or_else(|e| panic!("{e}"));
    let (code, out, err) = run_bin(&["golden", "check", "--all", "--golden-dir", g.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(&format!("{n_cases} case(s): {n_cases} match, 0 differ")),
        "{out}"
    );
    for line in out
        .lines()
        .filter(|l| l.starts_with("golden ") && l.contains(": match"))
    {
        assert!(
            line.contains("max |Δ| vs golden 0)"),
            "a rerun must reproduce the bits: {line}"
        );
    }
}

#[test]
fn one_percent_edit_of_one_value_fails_naming_the_site() {
    // Three sites of three cases, at the first, a middle and a late element.
    for (case, tensor, site, idx) in [
        ("tiny-v3-q8_0", "mha.L1.attn_out", "L1.attn_out", 0usize),
        ("yarn-v3-f32", "mha.L1.q_pe_roped", "L1.q_pe_roped", 17),
        ("k256-q4_k_m", "mqa.L1.attn_latent", "L1.attn_latent", 500),
    ] {
        let (_t, g) = copy_case(case);
        let (code, out, err) = check(&g, case);
        assert_eq!(code, 0, "unedited copy of {case} must pass: {out}\n{err}");
        let file = g.join(case).join("trace.safetensors");
        let (off, v) = locate(&file, tensor, idx);
        assert!(v != 0.0 && v.is_finite());
        let mut b = std::fs::read(&file).unwrap();
        b[off..off + 4].copy_from_slice(&(v * 1.01).to_le_bytes());
        std::fs::write(&file, b).unwrap();
        let (code, out, err) = check(&g, case);
        assert_eq!(code, 1, "{case}: {out}\n{err}");
        assert!(
            out.contains(&format!(
                "DIFFERS: first at {} {site}",
                tensor.split('.').next().unwrap()
            )),
            "{case}: {out}"
        );
        assert!(out.contains("◀ first"), "{out}");
    }
}

#[test]
fn changed_gguf_is_an_error_not_a_pass() {
    let case = "tiny-v3-q8_0";
    let (t, g) = copy_case(case);
    let gguf = t.path().join("golden/models/tiny-v3-q8_0.gguf");
    let mut b = std::fs::read(&gguf).unwrap();
    let n = b.len();
    b[n - 100] ^= 0x01; // one bit of tensor data
    std::fs::write(&gguf, b).unwrap();
    let (code, out, err) = check(&g, case);
    assert_eq!(code, 2, "{out}\n{err}");
    assert!(err.contains("GGUF changed: sha256"), "{err}");
    assert!(err.contains("tiny-v3-q8_0.gguf"), "{err}");

    std::fs::remove_file(&gguf).unwrap();
    let (code, _, err) = check(&g, case);
    assert_eq!(code, 2);
    assert!(err.contains("the case's GGUF is missing"), "{err}");
}

#[test]
fn missing_or_extra_site_is_an_error() {
    let case = "legacy-kvb-f32";
    // A site in the golden that the recomputation does not produce.
    let (_t, g) = copy_case(case);
    let mpath = g.join(case).join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    let mut extra = m["sites"][0].clone();
    extra["site"] = "L0.attn_out".into();
    m["sites"].as_array_mut().unwrap().push(extra);
    std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let (code, _, err) = check(&g, case);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("missing site(s): L0.attn_out of trace"), "{err}");

    // A recomputed site the golden lacks.
    let (_t2, g2) = copy_case(case);
    let mpath = g2.join(case).join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    let removed = m["sites"].as_array_mut().unwrap().remove(3);
    std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let (code, _, err) = check(&g2, case);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!(
            "site {} of trace {} is recomputed but not in the golden",
            removed["site"].as_str().unwrap(),
            removed["trace"].as_str().unwrap()
        )),
        "{err}"
    );

    // A tensor missing from trace.safetensors.
    let (_t3, g3) = copy_case(case);
    let mpath = g3.join(case).join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    let i = m["sites"]
        .as_array()
        .unwrap()
        .iter()
        .position(|s| s["tensor"].is_string())
        .unwrap();
    m["sites"][i]["tensor"] = "no.such.tensor".into();
    std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let (code, _, err) = check(&g3, case);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("tensor `no.such.tensor`"), "{err}");
}

#[test]
fn record_refuses_to_overwrite_without_force_and_writes_atomically() {
    let case = "tiny-v3-q8_0";
    let (t, g) = copy_case(case);
    let model = t.path().join("golden/models/tiny-v3-q8_0.gguf");
    let before = std::fs::read(g.join(case).join("trace.safetensors")).unwrap();
    let args = |force: bool| {
        let mut v = vec![
            "golden",
            "record",
            "--case",
            case,
            "--golden-dir",
            g.to_str().unwrap(),
            "--model",
            model.to_str().unwrap(),
            "--layer",
            "1",
            "--seqs",
            "2,5",
            "--page-size",
            "4",
            "--splits",
            "2",
            "--chunk-size",
            "2",
            "--new-tokens",
            "2",
            "--backend",
            "cpu",
        ];
        if force {
            v.push("--force");
        }
        v.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let a = args(false);
    let (code, _, err) = run_bin(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 2);
    assert!(err.contains("exists") && err.contains("--force"), "{err}");
    assert!(std::fs::read(g.join(case).join("trace.safetensors")).unwrap() == before);

    let a = args(true);
    let (code, out, err) = run_bin(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{out}\n{err}");
    // Same inputs: the same bytes, and no temporary file left behind.
    assert!(
        std::fs::read(g.join(case).join("trace.safetensors")).unwrap() == before,
        "re-recording the same run must give the same bytes"
    );
    let names: Vec<String> = std::fs::read_dir(g.join(case))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(g.join(case).join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["gguf"]["path"], "golden/models/tiny-v3-q8_0.gguf");
    assert_eq!(m["schema"], 1);
    assert_eq!(m["run"]["layers"], serde_json::json!([1]));
    assert_eq!(m["backend"]["kind"], "cpu");
    assert!(m["tolerance"]["golden"]["rtol"].as_f64().unwrap() <= 1e-3);
}

#[test]
fn record_refuses_a_model_outside_the_repository_and_a_diverging_run() {
    let (_t, g) = copy_case("tiny-v3-q8_0");
    let outside = repo().join("golden/models/tiny-v3-q8_0.gguf");
    let (code, _, err) = run_bin(&[
        "golden",
        "record",
        "--case",
        "new-case",
        "--golden-dir",
        g.to_str().unwrap(),
        "--model",
        outside.to_str().unwrap(),
        "--backend",
        "cpu",
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("inside the repository"), "{err}");

    let (code, out, _) = run_bin(&[
        "golden",
        "record",
        "--case",
        "bad-case",
        "--golden-dir",
        g.to_str().unwrap(),
        "--backend",
        "cpu",
        "--layer",
        "1",
        "--inject",
        "phantom-output",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("not recorded"), "{out}");
    assert!(!g.join("bad-case").exists());
}

/// A case recorded into `./golden` by hand (docs/guide.md's `golden record` example run without
/// `--golden-dir`) is named by the gate's case check, not reported as a bare count mismatch.
#[test]
fn an_extra_case_under_golden_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let g = tmp.path().join("golden");
    std::fs::create_dir_all(g.join("models")).unwrap();
    std::fs::write(g.join("models/tiny-v3-q8_0.gguf"), b"").unwrap();
    for case in ["tiny-v3-q8_0", "embedded-default", "my-case"] {
        std::fs::create_dir_all(g.join(case)).unwrap();
        std::fs::write(g.join(case).join("manifest.json"), b"{}").unwrap();
    }
    let e = case_set_problems(&g).unwrap_err();
    assert!(e.contains("not committed fixture cases: my-case"), "{e}");
    assert!(!e.contains("lacks"), "{e}");
    std::fs::remove_dir_all(g.join("my-case")).unwrap();
    std::fs::remove_dir_all(g.join("embedded-default")).unwrap();
    let e = case_set_problems(&g).unwrap_err();
    assert!(e.contains("lacks the case(s) of fixture(s): embedded-default"), "{e}");
    std::fs::create_dir_all(g.join("embedded-default")).unwrap();
    std::fs::write(g.join("embedded-default/manifest.json"), b"{}").unwrap();
    assert_eq!(case_set_problems(&g), Ok(2));
}

/// docs/guide.md's `golden record` example writes into a temporary folder, never into the
/// committed `golden/` (where an extra case fails `committed_cases_all_match`).
#[test]
fn guide_golden_record_example_uses_a_temporary_golden_dir() {
    let guide = std::fs::read_to_string(repo().join("docs/guide.md")).unwrap();
    let lines: Vec<&str> = guide
        .lines()
        .filter(|l| l.trim_start().starts_with("mla-diff golden record"))
        .collect();
    assert!(!lines.is_empty());
    for l in lines {
        assert!(l.contains("--golden-dir"), "{l}");
        assert!(!l.contains("--golden-dir golden"), "{l}");
    }
}

/// Cases that cannot be checked: one is its error (exit 2, the one stderr line); several are an
/// inconclusive verdict, each ERROR line on stdout and the count as the last line.
#[test]
fn cases_that_cannot_be_checked_exit_2_one_as_its_error_several_as_inconclusive() {
    let (_tmp, g) = copy_case("embedded-default");
    for case in ["a", "b"] {
        std::fs::create_dir_all(g.join(case)).unwrap();
        std::fs::copy(
            g.join("embedded-default/manifest.json"),
            g.join(case).join("manifest.json"),
        )
        .unwrap();
    }
    let (code, out, err) = check(&g, "a");
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.starts_with("mla-diff: error: golden case `a`"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");

    let (code, out, err) = run_bin(&[
        "golden",
        "check",
        "--golden-dir",
        g.to_str().unwrap(),
        "--case",
        "a",
        "--case",
        "b",
    ]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(!err.contains("error"), "{err}");
    assert_eq!(out.matches(": ERROR: golden case").count(), 2, "{out}");
    assert_eq!(
        out.lines().last(),
        Some("inconclusive: 2 golden cases could not be checked (the lines marked ERROR above)"),
        "{out}"
    );
}

/// A manifest's numbers are checked as the command line checks its flags: lengths that add up
/// only by wrapping past 2^64, an empty layer list, a zero page size, split count or chunk
/// size, and a negative tolerance are each exit 2, one line naming the manifest and the field —
/// never a panic, and never a match.
#[test]
fn hostile_manifest_numbers_are_errors_naming_the_field() {
    let case = "embedded-default";
    type Edit = fn(&mut serde_json::Value);
    let cases: Vec<(&str, Edit)> = vec![
        ("run.batch.seqs[0]", |m| {
            m["run"]["batch"]["seqs"][0]["len"] = (u64::MAX - 2).into()
        }),
        ("run.layers", |m| m["run"]["layers"] = serde_json::json!([])),
        ("run.layers[0]", |m| m["run"]["layers"] = serde_json::json!([u64::MAX])),
        ("run.path_options.page_size", |m| {
            m["run"]["path_options"]["page_size"] = 0.into()
        }),
        ("run.path_options.page_size", |m| {
            m["run"]["path_options"]["page_size"] = u64::MAX.into()
        }),
        ("run.path_options.num_splits", |m| {
            m["run"]["path_options"]["num_splits"] = 0.into()
        }),
        ("run.path_options.chunk_size", |m| {
            m["run"]["path_options"]["chunk_size"] = 0.into()
        }),
        ("tolerance.golden.rel_l2", |m| {
            m["tolerance"]["golden"]["rel_l2"] = (-1.0).into()
        }),
        ("tolerance.reference_table[0].tolerance.rtol", |m| {
            m["tolerance"]["reference_table"][0]["tolerance"]["rtol"] = (-0.5).into()
        }),
    ];
    for (field, edit) in cases {
        let (_t, g) = copy_case(case);
        let mpath = g.join(case).join("manifest.json");
        let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
        edit(&mut m);
        std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
        let (code, out, err) = check(&g, case);
        assert_eq!(code, 2, "{field}: {out}\n{err}");
        assert!(!err.contains("panicked"), "{field}: {err}");
        assert!(
            err.contains("mla-diff: error:") && err.contains("manifest.json") && err.contains(field),
            "{field}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{field}: {err}");
    }
}
