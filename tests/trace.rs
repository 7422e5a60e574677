//! The trace and the timeline of a real run (the pipeline example on a simulated GPU, with a host
//! budget): the Chrome trace is well formed (every begin has its end on its track, time never
//! runs backwards on a track), the ledger counters stay within their budgets, the bytes of the
//! copy spans are the bytes `TransferStats` counted, every eviction names the load that caused
//! it; the timeline is valid SVG whose ledger line never crosses its budget line, and headless
//! Chromium draws it (skipped, saying so, where there is no Chromium).

#[allow(dead_code, unused_imports)]
#[path = "../examples/pipeline/main.rs"]
mod pipeline;

include!("ported/shim.rs");

use std::collections::HashMap;
use std::sync::OnceLock;

use residency::trace::Trace;
use serde_json::Value;

/// The pipeline run once on a simulated GPU under a host budget, traced by a trace installed as
/// the global subscriber (copies run on the simulated GPU's stream workers, transfers on lanes:
/// a per-thread subscriber would miss them); its report and records, shared by the tests.
fn traced() -> &'static (pipeline::PipelineReport, Vec<residency::trace::Record>) {
    static RUN: OnceLock<(pipeline::PipelineReport, Vec<residency::trace::Record>)> =
        OnceLock::new();
    RUN.get_or_init(|| {
        let trace = Trace::new();
        trace
            .install_global()
            .expect("no other global subscriber in this test binary");
        let dir = tempfile::tempdir().unwrap();
        traced_run(&trace, dir.path(), FLAGS)
    })
}

/// The pipeline run with `flags`, recorded by `trace`.
fn traced_run(
    trace: &Trace,
    dir: &std::path::Path,
    flags: &[&str],
) -> (pipeline::PipelineReport, Vec<residency::trace::Record>) {
    let mut raw: Vec<String> = ["--steps", "2", "--prompts", "2", "--quiet", "--cache"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    raw.push(dir.display().to_string());
    raw.extend(flags.iter().map(|s| s.to_string()));
    let args = pipeline::parse_args(&raw).expect("valid flags");
    let report = pipeline::run(&args).expect("the run succeeds");
    // Copies still queued when the run returned (prefetches nobody used) execute on their
    // stream workers, which drain their queues: wait until every copy span has ended.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let r = trace.records();
        let open = r.iter().filter(|x| x.name == "copy").fold(0i64, |n, x| {
            n + match x.kind {
                residency::trace::Kind::Begin => 1,
                residency::trace::Kind::End => -1,
                _ => 0,
            }
        });
        if open == 0 || std::time::Instant::now() > deadline {
            return (report, r);
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

const FLAGS: &[&str] = &["--sim-gpu", "6MiB@25GB/s", "--ram-budget", "3MiB"];

#[test]
fn a_traced_run_is_a_well_formed_chrome_trace_whose_figures_match_the_reports() {
    let (report, records) = traced();
    let json: Value =
        serde_json::from_str(&residency::trace::chrome_json(records)).expect("the trace is JSON");
    let events = json["traceEvents"]
        .as_array()
        .expect("the object format: traceEvents");
    assert!(events.len() > 100, "{} events", events.len());

    // Every B has its E on the same track, nested; time is monotonic per track.
    let mut stacks: HashMap<(u64, u64), Vec<String>> = HashMap::new();
    let mut last_ts: HashMap<(u64, u64), f64> = HashMap::new();
    for e in events {
        let ph = e["ph"].as_str().expect("every event has a phase");
        if ph == "M" {
            continue;
        }
        let track = (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap());
        let ts = e["ts"].as_f64().expect("every event has a time");
        let name = e["name"].as_str().unwrap().to_string();
        let last = last_ts.entry(track).or_insert(0.0);
        assert!(ts >= *last, "time ran backwards on {track:?} at {name}");
        *last = ts;
        match ph {
            "B" => stacks.entry(track).or_default().push(name),
            "E" => {
                let open = stacks.entry(track).or_default().pop();
                assert_eq!(
                    open.as_deref(),
                    Some(name.as_str()),
                    "E without its B on {track:?}"
                );
            }
            "i" | "C" => {}
            other => panic!("unexpected phase {other}"),
        }
    }
    for (track, open) in &stacks {
        assert!(open.is_empty(), "spans never ended on {track:?}: {open:?}");
    }

    // Counters never exceed their budgets: the sim's ledger and the host tier's. Every change of
    // a book is a sample, so the highest sample is the peak the books kept.
    let mut samples = HashMap::<String, usize>::new();
    let mut highest = HashMap::<String, u64>::new();
    for c in events.iter().filter(|e| e["ph"] == "C") {
        let a = &c["args"];
        let n = |k: &str| a[k].as_u64().unwrap_or(0);
        let name = c["name"].as_str().unwrap().to_string();
        let (used, budget) = if name == "host" {
            (n("held") + n("reading"), n("budget"))
        } else {
            (
                n("resident") + n("in_flight") + n("cached") + n("reserved"),
                n("budget"),
            )
        };
        if budget > 0 {
            assert!(used <= budget, "{name} at {}: {used} > {budget}", c["ts"]);
        }
        let h = highest.entry(name.clone()).or_default();
        *h = (*h).max(used);
        *samples.entry(name).or_default() += 1;
    }
    assert_eq!(
        highest.get("ledger sim:0").copied(),
        Some(report.peak.bytes())
    );
    assert_eq!(highest.get("host").copied(), Some(report.host.peak.bytes()));
    assert!(
        samples.get("ledger sim:0").copied().unwrap_or(0) > 10,
        "{samples:?}"
    );
    assert!(
        samples.get("host").copied().unwrap_or(0) > 10,
        "{samples:?}"
    );

    // The copy spans' bytes are what TransferStats counted, by source.
    let mut by_source = HashMap::<String, u64>::new();
    for e in events
        .iter()
        .filter(|e| e["ph"] == "B" && e["name"] == "copy")
    {
        assert_eq!(e["args"]["device"], "sim:0");
        *by_source
            .entry(e["args"]["source"].as_str().unwrap().to_string())
            .or_default() += e["args"]["bytes"].as_u64().unwrap();
    }
    let t = &report.transfers;
    assert!(
        t.bytes_staged.bytes() > 0 && t.bytes_direct.bytes() > 0,
        "{t:?}"
    );
    assert_eq!(
        by_source.get("staged").copied().unwrap_or(0),
        t.bytes_staged.bytes()
    );
    assert_eq!(
        by_source.get("pinned_in_place").copied().unwrap_or(0),
        t.bytes_direct.bytes()
    );
    assert_eq!(
        by_source.get("pageable").copied().unwrap_or(0),
        t.bytes_pageable.bytes()
    );
    // The three columns add up to every copy the trace saw.
    assert_eq!(by_source.values().sum::<u64>(), t.bytes_copied().bytes());

    // Every transfer on the sim says how its weight was copied (the field CUDA runs rely on).
    let transfers: Vec<&Value> = events
        .iter()
        .filter(|e| e["ph"] == "E" && e["name"] == "transfer")
        .collect();
    assert!(!transfers.is_empty());
    for e in transfers {
        let source = e["args"]["source"].as_str();
        assert!(
            matches!(source, Some("pinned_in_place" | "staged" | "pageable")),
            "{e}"
        );
    }

    // Every eviction names the load that caused it: the models of the load span it ran in.
    let mut loads: HashMap<(u64, u64), Vec<String>> = HashMap::new();
    let mut evictions = 0;
    for e in events {
        let track = (
            e["pid"].as_u64().unwrap_or(0),
            e["tid"].as_u64().unwrap_or(0),
        );
        match (e["ph"].as_str(), e["name"].as_str()) {
            (Some("B"), Some("load_models_gpu")) => loads
                .entry(track)
                .or_default()
                .push(e["args"]["models"].as_str().unwrap().to_string()),
            (Some("E"), Some("load_models_gpu")) => {
                loads.entry(track).or_default().pop();
            }
            (Some("B"), Some("evict")) => {
                evictions += 1;
                let load = e["args"]["load"].as_str().unwrap();
                let victim = e["args"]["victim"].as_str().unwrap();
                assert_eq!(
                    loads.get(&track).and_then(|l| l.last()).map(String::as_str),
                    Some(load),
                    "the eviction of {victim} names its load"
                );
                assert!(
                    !load.split(',').any(|m| m == victim),
                    "{victim} evicted for itself"
                );
                assert!(e["args"]["bytes"].as_u64().unwrap() > 0);
                assert!(e["args"]["required"].as_u64().unwrap() > 0);
            }
            _ => {}
        }
    }
    assert_eq!(
        evictions,
        report.evictions.len(),
        "one span per eviction reported"
    );
    assert!(evictions > 0, "the budget makes the run evict");
}

/// The points of `polyline`'s `points` attribute.
fn points(node: roxmltree::Node<'_, '_>) -> Vec<(f64, f64)> {
    node.attribute("points")
        .expect("a polyline has points")
        .split_whitespace()
        .map(|p| {
            let (x, y) = p.split_once(',').expect("x,y");
            (x.parse().unwrap(), y.parse().unwrap())
        })
        .collect()
}

#[test]
fn the_timeline_is_valid_svg_whose_ledger_line_never_crosses_its_budget_line() {
    let (_, records) = traced();
    let svg = residency::trace::timeline_svg(records);
    let doc = roxmltree::Document::parse(&svg).expect("well-formed XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let lines = |class: &str| -> HashMap<String, Vec<(f64, f64)>> {
        doc.descendants()
            .filter(|n| n.has_tag_name("polyline") && n.attribute("class") == Some(class))
            .map(|n| (n.attribute("data-series").unwrap().to_string(), points(n)))
            .collect()
    };
    let ledgers = lines("ledger");
    let budgets = lines("budget");
    for series in ["ledger sim:0", "host"] {
        let ledger = ledgers
            .get(series)
            .unwrap_or_else(|| panic!("{series} is drawn"));
        let budget = budgets
            .get(series)
            .unwrap_or_else(|| panic!("{series}'s budget"));
        assert!(ledger.len() > 10);
        for &(x, y) in ledger {
            // The budget line's height at x: its last point at or before x (SVG y grows down).
            let by = budget
                .iter()
                .take_while(|p| p.0 <= x)
                .last()
                .unwrap_or(&budget[0])
                .1;
            assert!(
                y >= by - 1e-6,
                "{series}: ledger at ({x}, {y}) above budget {by}"
            );
        }
    }
    let marks = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("mark evict"))
        .count();
    assert!(marks > 0, "evictions are marked");
    let copies = doc
        .descendants()
        .filter(|n| n.has_tag_name("title"))
        .filter(|n| n.text().is_some_and(|t| t.starts_with("copy ")))
        .count();
    assert!(copies > 0, "the copy lanes are drawn");
}

/// The first Chromium on the path.
fn chromium() -> Option<std::path::PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|name| {
            std::env::var_os("PATH")?
                .to_str()?
                .split(':')
                .map(|d| std::path::Path::new(d).join(name))
                .find(|p| p.is_file())
        })
}

/// A headless Chromium screenshot of `svg`; its PNG bytes.
fn screenshot(browser: &std::path::Path, dir: &std::path::Path, name: &str, svg: &str) -> Vec<u8> {
    let file = dir.join(format!("{name}.svg"));
    let png = dir.join(format!("{name}.png"));
    std::fs::write(&file, svg).unwrap();
    let out = std::process::Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            &format!(
                "--user-data-dir={}",
                dir.join(format!("{name}-profile")).display()
            ),
            &format!("--screenshot={}", png.display()),
            "--window-size=1200,500",
            &format!("file://{}", file.display()),
        ])
        .output()
        .expect("chromium runs");
    assert!(
        png.is_file(),
        "no screenshot: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(png).unwrap()
}

#[test]
fn headless_chromium_draws_the_timeline() {
    let Some(browser) = chromium() else {
        eprintln!("skipped: no chromium, chromium-browser or google-chrome on PATH");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_, records) = traced();
    let shot = screenshot(
        &browser,
        dir.path(),
        "timeline",
        &residency::trace::timeline_svg(records),
    );
    assert_eq!(&shot[..8], b"\x89PNG\r\n\x1a\n", "a PNG");
    // A blank page of the same size compresses to almost nothing; the picture does not.
    let blank = screenshot(
        &browser,
        dir.path(),
        "blank",
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="1200" height="500"><rect width="1200" height="500" fill="#ffffff"/></svg>"##,
    );
    assert!(
        shot.len() > 4 * blank.len(),
        "the screenshot ({} bytes) is not much more than a blank page ({} bytes)",
        shot.len(),
        blank.len()
    );
}
