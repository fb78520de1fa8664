//! `run --report`: the Markdown triage report and its heat map, written safely and reproducibly.

use crate::common::run_bin;

#[test]
fn report_names_the_class_and_writes_the_plot() {
    let dir = tempfile::tempdir().unwrap();
    let md = dir.path().join("r.md");
    let args = [
        "run",
        "--backend",
        "cpu",
        "--layer",
        "1",
        "--inject",
        "phantom-output",
        "--quiet",
        "--report",
        md.to_str().unwrap(),
    ];
    let (code, out, err) = run_bin(&args);
    assert_eq!(code, 1, "{out}\n{err}");
    let text = std::fs::read_to_string(&md).unwrap();
    let first = text.lines().next().unwrap();
    assert!(first.contains("phantom-output at L1.attn_out"), "{first}");
    let verdict = text.lines().nth(2).unwrap();
    assert!(
        verdict.contains("Finding **phantom-output** at `L1.attn_out`"),
        "{verdict}"
    );
    // The reproduce command reruns as is: output flags and --quiet removed.
    assert!(
        text.contains("```sh\nmla-diff run --backend cpu --layer 1 --inject phantom-output\n```"),
        "{text}"
    );
    assert!(text.contains("![rel_l2 per layer and path"));
    assert!(text.contains("(r.svg)"));
    assert_eq!(text.matches("<details>").count(), 4);
    let svg = std::fs::read_to_string(dir.path().join("r.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // 4 paths × 22 stages of cells, failing ones outlined: the three failing sites per path.
    assert!(svg.matches("<rect").count() > 80, "{}", svg.matches("<rect").count());

    // No overwrite without --force (report or plot), and the same run gives the same report
    // apart from its date line.
    let (code, _, err) = run_bin(&args);
    assert_eq!(code, 2);
    assert!(err.contains("--force"), "{err}");
    std::fs::remove_file(&md).unwrap();
    let (code, _, err) = run_bin(&args);
    assert_eq!(code, 2, "the plot alone must also block: {err}");
    let mut forced = args.to_vec();
    forced.push("--force");
    let (code, _, _) = run_bin(&forced);
    assert_eq!(code, 1);
    let again = std::fs::read_to_string(&md).unwrap();
    let strip = |s: &str| {
        s.lines()
            .filter(|l| !l.starts_with("Date: ") && !l.starts_with("mla-diff run"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(strip(&text), strip(&again));
    assert_eq!(std::fs::read_to_string(dir.path().join("r.svg")).unwrap(), svg);
}

#[test]
fn reproduce_command_drops_output_flags() {
    let args = [
        "run",
        "--layer",
        "3",
        "--report",
        "r.md",
        "--json=x.json",
        "--force",
        "--quiet",
        "--model",
        "my model.gguf",
        "--stats",
        "-q",
        "--wide",
    ];
    assert_eq!(
        mla_diff::output::triage::reproduce_from(args.iter().map(|s| s.to_string())),
        "mla-diff run --layer 3 --model 'my model.gguf'"
    );
}
