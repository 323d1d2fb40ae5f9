//! The timeline end to end: `fsdp launch --fsdp_trace_dir DIR` on 2 processes writes each
//! rank's Chrome trace (every step; every unit's forward and backward; every all-gather and
//! reduction with its bytes; the optimizer), and `fsdp trace plot` draws a step of every
//! rank as SVG and PNG.

use std::time::Duration;

use crate::common::{EXE, fsdp, launch, port};

/// Rank `rank`'s events, parsed.
fn events(dir: &std::path::Path, rank: usize) -> Vec<serde_json::Value> {
    let path = dir.join(format!("trace_rank{rank}.json"));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    doc["traceEvents"].as_array().unwrap().clone()
}

#[test]
fn a_launched_job_writes_each_ranks_timeline_and_plot_draws_a_step() {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("trace");
    let run = launch(
        &[
            "--num_processes",
            "2",
            "--main_process_port",
            &port(),
            "--fsdp_trace_dir",
            trace.to_str().unwrap(),
            EXE,
            "test",
            "--worker",
        ],
        Duration::from_secs(120),
    );
    assert_eq!(run.code, Some(0), "{}", run.out);
    let mut first_steps = Vec::new();
    for rank in 0..2 {
        let all = events(&trace, rank);
        let named = |n: &str| {
            all.iter()
                .any(|e| e["ph"] == "M" && e["args"]["name"] == n && e["pid"] == rank)
        };
        assert!(named(&format!("rank {rank}")) && named("compute") && named("communication"));
        let spans: Vec<&serde_json::Value> = all.iter().filter(|e| e["ph"] == "X").collect();
        let steps: Vec<(u64, f64, f64)> = spans
            .iter()
            .filter(|e| e["cat"] == "step")
            .map(|e| {
                let ts = e["ts"].as_f64().unwrap();
                (
                    e["args"]["step"].as_u64().unwrap(),
                    ts,
                    ts + e["dur"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(
            steps.iter().map(|s| s.0).collect::<Vec<_>>(),
            (0..8).collect::<Vec<_>>(),
            "rank {rank}: the test job's 8 steps"
        );
        first_steps.push(steps[0]);
        // Every step holds each unit's forward and backward, gathers and reductions with
        // their bytes on the communication lane, and one optimizer step.
        for &(n, from, to) in &steps {
            let inside = |cat: &str| -> Vec<&&serde_json::Value> {
                spans
                    .iter()
                    .filter(|e| {
                        let ts = e["ts"].as_f64().unwrap();
                        e["cat"] == cat && ts >= from && ts <= to
                    })
                    .collect()
            };
            let units = |cat: &str| -> std::collections::BTreeSet<String> {
                inside(cat)
                    .iter()
                    .map(|e| e["args"]["unit"].as_str().unwrap().to_string())
                    .collect()
            };
            let forward = units("forward");
            assert!(
                forward.contains("root") && forward.len() >= 3,
                "rank {rank}, step {n}: {forward:?}"
            );
            assert_eq!(units("backward"), forward, "rank {rank}, step {n}");
            for cat in ["all_gather", "reduce"] {
                let comm = inside(cat);
                assert!(!comm.is_empty(), "rank {rank}, step {n}: no {cat}");
                for e in comm {
                    assert_eq!(e["tid"], 1, "{e}");
                    assert!(e["args"]["bytes"].as_u64().unwrap() > 0, "{e}");
                }
            }
            // The ranks share this host: units are gathered through shared memory's blocks.
            let shared = |e: &&&serde_json::Value| e["args"]["through"] == "shared memory";
            assert!(
                inside("all_gather").iter().any(shared),
                "rank {rank}, step {n}: no gather went through shared memory"
            );
            assert_eq!(inside("optimizer").len(), 1, "rank {rank}, step {n}");
        }
    }
    // One clock: the ranks' first steps overlap in time.
    let (a, b) = (first_steps[0], first_steps[1]);
    assert!(a.1 < b.2 && b.1 < a.2, "{a:?} {b:?}");

    // The picture of a step, and its summary.
    let svg = tmp.path().join("step.svg");
    let out = fsdp()
        .args(["trace", "plot"])
        .arg(&trace)
        .arg("-o")
        .arg(&svg)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert_eq!(summary["step"], 7, "the last step by default");
    let ranks = summary["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    for r in ranks {
        for key in ["step_ms", "compute_ms", "communication_ms"] {
            assert!(r[key].as_f64().unwrap() > 0.0, "{key}: {r}");
        }
        // The hidden share is the communication the compute thread did not wait for, and
        // every part lies inside the step (times to the microsecond, the share to 1e-3;
        // a unit's forward spans its wait for the gather, so compute and waiting overlap).
        let f = |key: &str| r[key].as_f64().unwrap();
        let hidden = f("communication_hidden");
        let (waited, communication) = (f("waiting_for_communication_ms"), f("communication_ms"));
        let expected = (1.0 - waited / communication).max(0.0);
        // The share's own rounding, and what rounding both times to the microsecond moves it.
        let tolerance = 1e-3 + 0.5e-3 * (1.0 + waited / communication) / communication;
        assert!((hidden - expected).abs() <= tolerance, "{expected}: {r}");
        for part in [
            "compute_ms",
            "waiting_for_communication_ms",
            "communication_ms",
        ] {
            assert!(f(part) <= f("step_ms") + 1e-3, "{part}: {r}");
        }
    }
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.starts_with("<svg") && picture.trim_end().ends_with("</svg>"));
    for label in [
        "rank 0 compute",
        "rank 1 communication",
        "step 7 of 2 rank(s)",
    ] {
        assert!(picture.contains(label), "{label}");
    }
    assert!(picture.matches("<rect").count() > 20);

    let png = tmp.path().join("step.png");
    let out = fsdp()
        .args(["trace", "plot", "--step", "3"])
        .arg(&trace)
        .arg("-o")
        .arg(&png)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A compressed PNG of the SVG's size, with text where the SVG has it: dark glyph pixels
    // in the title row, beside the lanes (their names) and in the legend row — regions the
    // boxes never reach.
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.len() < 100_000, "{} bytes", bytes.len());
    let mut reader = png::Decoder::new(std::io::Cursor::new(&bytes))
        .read_info()
        .unwrap();
    let mut pixels = vec![0u8; reader.output_buffer_size().unwrap()];
    let frame = reader.next_frame(&mut pixels).unwrap();
    let (width, height) = (frame.width as usize, frame.height as usize);
    assert_eq!(frame.color_type, png::ColorType::Rgb);
    let svg_size = |attr: &str| -> usize {
        let at = picture.find(&format!("{attr}=\"")).unwrap() + attr.len() + 2;
        picture[at..]
            .split('"')
            .next()
            .unwrap()
            .parse::<f64>()
            .unwrap() as usize
    };
    assert_eq!((width, height), (svg_size("width"), svg_size("height")));
    let dark = |x0: usize, x1: usize, y0: usize, y1: usize| -> usize {
        (y0..y1)
            .flat_map(|y| (x0..x1).map(move |x| (x, y)))
            .filter(|&(x, y)| pixels[(y * width + x) * 3..][..3].iter().all(|&c| c < 0x50))
            .count()
    };
    assert!(dark(160, 600, 0, 24) > 100, "no title text");
    assert!(dark(0, 155, 46, height - 40) > 200, "no lane names");
    assert!(
        dark(160, width, height - 40, height) > 200,
        "no legend words"
    );

    // What it refuses, saying why.
    let refused = |args: &[&str]| {
        let out = fsdp().args(["trace", "plot"]).args(args).output().unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let t = trace.to_str().unwrap();
    let err = refused(&[t, "--step", "99", "-o", "x.svg"]);
    assert!(
        err.contains("step 99 is not in every rank's trace"),
        "{err}"
    );
    let err = refused(&[t, "-o", "x.gif"]);
    assert!(err.contains("not `.gif`"), "{err}");
    let err = refused(&[tmp.path().to_str().unwrap(), "-o", "x.svg"]);
    assert!(err.contains("holds no trace_rank"), "{err}");
}
