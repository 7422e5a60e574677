//! The timeline picture of a recorded run ([`super::Trace::timeline_svg`]): what a reader needs
//! to see at once — where memory went, and whether transfers hid behind compute.
//!
//! Layout, top to bottom, on one time axis (milliseconds since the trace began):
//!
//! - one chart per ledger counter that ever held bytes (each device, then the host tier): the
//!   ledger's columns stacked (resident, in flight, cached casts, reserved; the host tier: held,
//!   reading) under the ledger's total as a step line (`<polyline class="ledger">`), and the
//!   budget as a dashed line (`<polyline class="budget">`), both tagged `data-series`; each load
//!   (`load_models_gpu`) a grey mark with its models' names, each eviction (`evict`) a red mark
//!   with the victim's name;
//! - the lanes: `compute` (spans named `compute`, which an engine or example opens around its
//!   forwards, with the compute thread's waits on copies and lanes in red over them), one row per
//!   device stream (the `copy` spans as they executed, coloured by source) and one per transfer
//!   lane thread (its `transfer` spans: patching, casting and enqueueing on the host).
//!
//! Pure: records in, text out. Within one pixel column the ledger line keeps the column's
//! first, highest, lowest and last sample, so no peak is lost however long the run; bars closer
//! than a pixel are merged (their count is in the tooltip). Cost O(records log records).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::{Kind, Record, Trace};

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 170.0;
const RIGHT: f64 = 20.0;
const CHART_H: f64 = 150.0;
const ROW_H: f64 = 16.0;

/// Colours of the stacked columns, bottom first (opaque: each is drawn over the ones above it).
const FILLS: [&str; 4] = ["#9dbcd9", "#f7c08a", "#a8d5a0", "#cfcfcf"];

/// A counter series: its samples in time order (ns, columns), with the column names.
struct Series {
    name: String,
    columns: Vec<&'static str>,
    samples: Vec<(u64, Vec<f64>, f64)>,
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The counter series in `records`, devices first (in name order), the host tier last.
fn series(records: &[Record]) -> Vec<Series> {
    let mut by_name: BTreeMap<String, Series> = BTreeMap::new();
    for r in records.iter().filter(|r| r.kind == Kind::Counter) {
        let columns: Vec<&'static str> = if r.name == "host" {
            vec!["held", "reading"]
        } else {
            vec!["resident", "in_flight", "cached", "reserved"]
        };
        let values: Vec<f64> = columns.iter().map(|c| r.number(c).unwrap_or(0.0)).collect();
        let budget = r.number("budget").unwrap_or(0.0);
        by_name
            .entry(r.name.to_string())
            .or_insert_with(|| Series {
                name: r.name.to_string(),
                columns,
                samples: Vec::new(),
            })
            .samples
            .push((r.ts_ns, values, budget));
    }
    let mut out: Vec<Series> = by_name
        .into_values()
        .filter(|s| {
            s.samples
                .iter()
                .any(|(_, v, _)| v.iter().sum::<f64>() > 0.0)
        })
        .collect();
    out.sort_by_key(|s| (s.name == "host", s.name.clone()));
    out
}

/// A span as an interval: its track, name, begin and end records, start and end (ns).
struct Interval<'a> {
    track: u32,
    name: &'a str,
    begin: &'a Record,
    end_record: Option<&'a Record>,
    start: u64,
    end: u64,
}

impl Interval<'_> {
    /// Field `f` as text: as recorded late (on the end), else at the start.
    fn text(&self, f: &str) -> Option<String> {
        self.end_record
            .and_then(|r| r.field(f))
            .or_else(|| self.begin.field(f))
            .map(|v| v.text())
    }
}

/// Every span interval, by pairing each begin with the next end on its track (spans nest on a
/// thread). A span still open at the end of the records runs to `t_end`.
fn intervals(records: &[Record], t_end: u64) -> Vec<Interval<'_>> {
    let mut open: BTreeMap<u32, Vec<&Record>> = BTreeMap::new();
    let mut out = Vec::new();
    for r in records {
        match r.kind {
            Kind::Begin => open.entry(r.track).or_default().push(r),
            Kind::End => {
                if let Some(b) = open.get_mut(&r.track).and_then(Vec::pop) {
                    out.push(Interval {
                        track: r.track,
                        name: &b.name,
                        begin: b,
                        end_record: Some(r),
                        start: b.ts_ns,
                        end: r.ts_ns,
                    });
                }
            }
            _ => {}
        }
    }
    for (track, stack) in open {
        for b in stack {
            out.push(Interval {
                track,
                name: &b.name,
                begin: b,
                end_record: None,
                start: b.ts_ns,
                end: t_end,
            });
        }
    }
    out
}

struct Canvas {
    svg: String,
    t_end: f64,
}

impl Canvas {
    fn x(&self, ns: f64) -> f64 {
        LEFT + ns / self.t_end * (WIDTH - LEFT - RIGHT)
    }
}

/// The SVG document for `records`.
pub fn svg(records: &[Record]) -> String {
    let t_end = records.iter().map(|r| r.ts_ns).max().unwrap_or(0).max(1);
    let all_series = series(records);
    let spans = intervals(records, t_end);
    let mut c = Canvas {
        svg: String::new(),
        t_end: t_end as f64,
    };
    let mut y = 40.0;
    let mut body = String::new();
    std::mem::swap(&mut body, &mut c.svg);
    for s in &all_series {
        y = chart(&mut c, s, records, y) + 30.0;
    }
    y = lanes(&mut c, &spans, y);
    let axis_y = y + 10.0;
    axis(&mut c, axis_y);
    let height = axis_y + 40.0;
    let mut doc = String::new();
    let _ = writeln!(
        doc,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        doc,
        r##"<rect x="0" y="0" width="{WIDTH}" height="{height:.0}" fill="#ffffff"/>"##
    );
    let _ = writeln!(
        doc,
        r##"<text x="10" y="22" font-size="15" font-weight="bold">residency timeline</text><text x="180" y="22" fill="#555">{:.1} ms · ledgers against their budgets (dashed) · loads (grey) and evictions (red) · copy and compute lanes</text>"##,
        t_end as f64 / 1e6
    );
    if all_series.is_empty() && spans.is_empty() {
        let _ = writeln!(
            doc,
            r#"<text x="10" y="60">nothing was recorded (was the layer installed globally?)</text>"#
        );
    }
    doc.push_str(&c.svg);
    doc.push_str("</svg>\n");
    doc
}

/// One ledger chart, its top at `top`; returns its bottom.
fn chart(c: &mut Canvas, s: &Series, records: &[Record], top: f64) -> f64 {
    let max_total = s
        .samples
        .iter()
        .map(|(_, v, _)| v.iter().sum::<f64>())
        .fold(0.0, f64::max);
    let max_budget = s.samples.iter().map(|(_, _, b)| *b).fold(0.0, f64::max);
    let vmax = max_total.max(max_budget).max(1.0) * 1.08;
    let bottom = top + CHART_H;
    let yv = |v: f64| bottom - v / vmax * CHART_H;
    let series = escape(&s.name);
    let label = if s.name == "host" {
        "host tier".to_string()
    } else {
        s.name.clone()
    };
    let _ = writeln!(
        c.svg,
        r##"<text x="10" y="{:.1}" font-weight="bold">{}</text><text x="10" y="{:.1}" fill="#555">peak {} of {}</text>"##,
        top + 12.0,
        escape(&label),
        top + 26.0,
        mib(max_total),
        if max_budget > 0.0 {
            mib(max_budget)
        } else {
            "no budget".into()
        }
    );
    let _ = writeln!(
        c.svg,
        r##"<rect x="{LEFT}" y="{top:.1}" width="{:.1}" height="{CHART_H}" fill="#f7f7f7" stroke="#ccc"/>"##,
        WIDTH - LEFT - RIGHT
    );
    let buckets = buckets(c, s);
    let x_end = c.x(c.t_end);
    // Stacked columns: cumulative sums as step polygons, the largest first.
    for k in (0..s.columns.len()).rev() {
        let mut pts = format!("{:.1},{:.1}", buckets[0].px as f64, bottom);
        let mut prev: Option<f64> = None;
        for b in &buckets {
            let v: f64 = b.columns[..=k].iter().sum();
            if let Some(p) = prev {
                let _ = write!(pts, " {:.1},{:.1}", b.px as f64, yv(p));
            }
            let _ = write!(pts, " {:.1},{:.1}", b.px as f64, yv(v));
            prev = Some(v);
        }
        if let Some(p) = prev {
            let _ = write!(pts, " {x_end:.1},{:.1} {x_end:.1},{bottom:.1}", yv(p));
        }
        let _ = writeln!(
            c.svg,
            r#"<polygon class="column" data-column="{}" points="{pts}" fill="{}" stroke="none"/>"#,
            s.columns[k],
            FILLS[k % FILLS.len()]
        );
    }
    // The ledger's total, as a step line keeping every pixel column's extremes.
    let mut pts = String::new();
    let mut prev: Option<f64> = None;
    for b in &buckets {
        let x = b.px as f64;
        if let Some(p) = prev {
            let _ = write!(pts, "{x:.1},{:.1} ", yv(p));
        }
        for v in [b.first, b.max, b.min, b.last] {
            let _ = write!(pts, "{x:.1},{:.1} ", yv(v));
        }
        prev = Some(b.last);
    }
    if let Some(p) = prev {
        let _ = write!(pts, "{x_end:.1},{:.1}", yv(p));
    }
    let _ = writeln!(
        c.svg,
        r##"<polyline class="ledger" data-series="{series}" points="{}" fill="none" stroke="#1f3b5a" stroke-width="1.5"/>"##,
        pts.trim_end()
    );
    // The budget (a step line too: a budget can be set after the first sample).
    if max_budget > 0.0 {
        let mut pts = String::new();
        let mut prev: Option<f64> = None;
        for b in &buckets {
            let x = b.px as f64;
            if prev != Some(b.budget) {
                if let Some(p) = prev {
                    let _ = write!(pts, "{x:.1},{:.1} ", yv(p));
                }
                let _ = write!(pts, "{x:.1},{:.1} ", yv(b.budget));
                prev = Some(b.budget);
            }
        }
        let _ = write!(pts, "{x_end:.1},{:.1}", yv(prev.unwrap_or(0.0)));
        let _ = writeln!(
            c.svg,
            r##"<polyline class="budget" data-series="{series}" points="{pts}" fill="none" stroke="#c0392b" stroke-width="1.2" stroke-dasharray="6 3"/>"##
        );
    }
    legend(c, &s.columns, top);
    marks(c, &s.name, records, top, bottom);
    bottom
}

/// One pixel column of a chart: (first, max, min, last) of the total, and the last sample's
/// columns and budget.
struct Bucket {
    px: i64,
    first: f64,
    max: f64,
    min: f64,
    last: f64,
    columns: Vec<f64>,
    budget: f64,
}

/// The samples of `s` by pixel column.
fn buckets(c: &Canvas, s: &Series) -> Vec<Bucket> {
    let mut buckets: Vec<Bucket> = Vec::new();
    for (ts, values, budget) in &s.samples {
        let px = c.x(*ts as f64).round() as i64;
        let total: f64 = values.iter().sum();
        match buckets.last_mut() {
            Some(b) if b.px == px => {
                b.max = b.max.max(total);
                b.min = b.min.min(total);
                b.last = total;
                b.columns = values.clone();
                b.budget = *budget;
            }
            _ => buckets.push(Bucket {
                px,
                first: total,
                max: total,
                min: total,
                last: total,
                columns: values.clone(),
                budget: *budget,
            }),
        }
    }
    buckets
}

/// The legend of a chart's columns, at its top.
fn legend(c: &mut Canvas, columns: &[&str], top: f64) {
    // Legend.
    let mut lx = LEFT + 6.0;
    for (k, col) in columns.iter().enumerate() {
        let _ = writeln!(
            c.svg,
            r#"<rect x="{lx:.1}" y="{:.1}" width="9" height="9" fill="{}"/><text x="{:.1}" y="{:.1}" font-size="10">{col}</text>"#,
            top + 5.0,
            FILLS[k % FILLS.len()],
            lx + 12.0,
            top + 13.0
        );
        lx += 14.0 + 6.5 * col.len() as f64 + 10.0;
    }
}

/// The loads (and, on a device's chart, its evictions) of `records` as marks on the chart
/// `name` between `top` and `bottom`.
fn marks(c: &mut Canvas, name: &str, records: &[Record], top: f64, bottom: f64) {
    // Loads and evictions.
    let device = name.strip_prefix("ledger ");
    // Marks less than a label's width apart share a column of labels.
    let mut group_x = f64::NEG_INFINITY;
    let mut n = 0usize;
    for r in records.iter().filter(|r| r.kind == Kind::Begin) {
        let (colour, text) = match r.name.as_ref() {
            "load_models_gpu" if device.is_some() => (
                "#777",
                r.field("models").map(|v| v.text()).unwrap_or_default(),
            ),
            "evict"
                if device.is_some() && r.field("device").map(|v| v.text()).as_deref() == device =>
            {
                (
                    "#c0392b",
                    format!(
                        "✕ {}",
                        r.field("victim").map(|v| v.text()).unwrap_or_default()
                    ),
                )
            }
            _ => continue,
        };
        let x = c.x(r.ts_ns as f64);
        if x - group_x > 70.0 {
            group_x = x;
            n = 0;
        }
        n += 1;
        let shown = n <= 9;
        let ty = top + 26.0 + (n.min(10) - 1) as f64 * 11.0;
        let why = match r.name.as_ref() {
            "evict" => format!(
                "evicted {} ({} bytes) for the load of {}: {} needed, {} free",
                r.field("victim").map(|v| v.text()).unwrap_or_default(),
                r.field("bytes").map(|v| v.text()).unwrap_or_default(),
                r.field("load").map(|v| v.text()).unwrap_or_default(),
                r.field("required").map(|v| v.text()).unwrap_or_default(),
                r.field("free").map(|v| v.text()).unwrap_or_default(),
            ),
            _ => format!("load of {text}"),
        };
        let _ = writeln!(
            c.svg,
            r##"<g class="mark {}"><title>{}</title><line x1="{x:.1}" y1="{top:.1}" x2="{x:.1}" y2="{bottom:.1}" stroke="{colour}" stroke-width="0.8" stroke-dasharray="2 2"/><text x="{:.1}" y="{ty:.1}" font-size="9" fill="{colour}" stroke="#f7f7f7" stroke-width="2.5" paint-order="stroke">{}</text></g>"##,
            if r.name == "evict" { "evict" } else { "load" },
            escape(&why),
            group_x + 2.0,
            if shown {
                escape(&text)
            } else if n == 10 {
                "…".to_string()
            } else {
                String::new()
            }
        );
    }
}

fn mib(bytes: f64) -> String {
    format!("{:.2} MiB", bytes / (1024.0 * 1024.0))
}

/// A bar to draw: start and end in ns, colour, tooltip.
struct Bar {
    start: u64,
    end: u64,
    colour: &'static str,
    tip: String,
}

/// The row and bar a span is drawn as in the lanes (`None`: not drawn there): compute and its
/// waits on the compute row, copies on their stream's row, lane work on its lane's.
fn bar_of(i: &Interval<'_>) -> Option<((u8, String), Bar)> {
    let text = |i: &Interval<'_>, f: &str| i.text(f);
    let (key, colour, tip) = match i.name {
        "compute" => (
            (0u8, "compute".to_string()),
            "#76b7b2",
            format!(
                "compute {}",
                text(i, "model")
                    .or_else(|| text(i, "what"))
                    .unwrap_or_default()
            ),
        ),
        "copy_wait" | "lane_wait" => (
            (0u8, "compute".to_string()),
            "#e15759",
            format!("compute waited ({})", i.name),
        ),
        "copy" => {
            let source = text(i, "source").unwrap_or_default();
            let colour = match source.as_str() {
                "pinned_in_place" => "#59a14f",
                "staged" => "#4e79a7",
                _ => "#f28e2b",
            };
            (
                (
                    1u8,
                    format!(
                        "{} stream {}",
                        text(i, "device").unwrap_or_default(),
                        text(i, "stream").unwrap_or_default()
                    ),
                ),
                colour,
                format!(
                    "copy {} bytes, {source}",
                    text(i, "bytes").unwrap_or_default()
                ),
            )
        }
        "transfer" => {
            let name = Trace::track_name(i.track);
            let lane = name.strip_prefix("residency-lane-")?;
            (
                (2u8, format!("lane {lane} (host)")),
                "#b07aa1",
                format!(
                    "{} {}",
                    text(i, "model").unwrap_or_default(),
                    text(i, "weight").unwrap_or_default()
                ),
            )
        }
        _ => return None,
    };
    Some((
        key,
        Bar {
            start: i.start,
            end: i.end,
            colour,
            tip,
        },
    ))
}

/// The lanes, their top at `top`; returns their bottom.
fn lanes(c: &mut Canvas, spans: &[Interval<'_>], top: f64) -> f64 {
    let mut rows: BTreeMap<(u8, String), Vec<Bar>> = BTreeMap::new();
    for (key, bar) in spans.iter().filter_map(bar_of) {
        rows.entry(key).or_default().push(bar);
    }
    if rows.is_empty() {
        return top;
    }
    let _ = writeln!(
        c.svg,
        r##"<text x="10" y="{:.1}" font-weight="bold">lanes</text><text x="60" y="{:.1}" fill="#555" font-size="10">copies: pinned in place (green), staged (blue), pageable (orange); compute (teal), waiting on a copy (red); lane work (purple)</text>"##,
        top + 10.0,
        top + 10.0
    );
    let mut y = top + 18.0;
    for ((_, label), mut bars) in rows {
        let _ = writeln!(
            c.svg,
            r##"<text x="10" y="{:.1}" font-size="10">{}</text><rect x="{LEFT}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="#fafafa" stroke="#eee"/>"##,
            y + ROW_H - 4.0,
            escape(&label),
            WIDTH - LEFT - RIGHT,
            ROW_H - 2.0
        );
        // Waits are drawn over compute.
        bars.sort_by_key(|b| (b.colour == "#e15759", b.start));
        let px_ns = c.t_end / (WIDTH - LEFT - RIGHT);
        // Bars less than a pixel apart merge; a merged bar's opacity is the share of its extent
        // they cover, so many short waits never paint as one long one.
        let mut merged: Vec<(Bar, usize, u64)> = Vec::new();
        for b in bars {
            let busy = b.end.saturating_sub(b.start);
            match merged.last_mut() {
                Some((m, n, covered))
                    if m.colour == b.colour && (b.start as f64) < m.end as f64 + px_ns =>
                {
                    *covered += b.end.saturating_sub(b.start.max(m.end));
                    m.end = m.end.max(b.end);
                    *n += 1;
                }
                _ => merged.push((b, 1, busy)),
            }
        }
        for (b, n, covered) in merged {
            let x0 = c.x(b.start as f64);
            let w = (c.x(b.end as f64) - x0).max(0.6);
            let extent = b.end.saturating_sub(b.start).max(1);
            let opacity = if n > 1 {
                (covered as f64 / extent as f64).clamp(0.2, 1.0)
            } else {
                1.0
            };
            let tip = if n > 1 {
                format!(
                    "{} and {} more: {:.0} % of {:.2} ms",
                    b.tip,
                    n - 1,
                    opacity * 100.0,
                    extent as f64 / 1e6
                )
            } else {
                format!("{} ({:.3} ms)", b.tip, extent as f64 / 1e6)
            };
            let _ = writeln!(
                c.svg,
                r#"<rect x="{x0:.1}" y="{:.1}" width="{w:.1}" height="{:.1}" fill="{}" fill-opacity="{opacity:.2}"><title>{}</title></rect>"#,
                y + 1.0,
                ROW_H - 4.0,
                b.colour,
                escape(&tip)
            );
        }
        y += ROW_H;
    }
    y
}

/// The time axis at `y`.
fn axis(c: &mut Canvas, y: f64) {
    let ms = c.t_end / 1e6;
    let step = [
        0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4,
    ]
    .into_iter()
    .find(|s| ms / s <= 12.0)
    .unwrap_or(2e4);
    let _ = writeln!(
        c.svg,
        r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#333"/>"##,
        WIDTH - RIGHT
    );
    let mut t = 0.0;
    while t <= ms + 1e-9 {
        let x = c.x(t * 1e6);
        let _ = writeln!(
            c.svg,
            r##"<line x1="{x:.1}" y1="{y:.1}" x2="{x:.1}" y2="{:.1}" stroke="#333"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="10">{t} ms</text>"##,
            y + 4.0,
            y + 16.0
        );
        t += step;
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Fields, Value};
    use super::*;

    fn rec(kind: Kind, ts: u64, name: &str, fields: Fields) -> Record {
        Record {
            kind,
            ts_ns: ts,
            track: 1,
            name: name.to_string().into(),
            target: "t",
            fields,
        }
    }

    fn ledger(ts: u64, resident: u64, budget: u64) -> Record {
        rec(
            Kind::Counter,
            ts,
            "ledger sim:0",
            vec![
                ("counter", Value::Str("ledger".into())),
                ("device", Value::Str("sim:0".into())),
                ("resident", Value::U64(resident)),
                ("in_flight", Value::U64(0)),
                ("cached", Value::U64(0)),
                ("reserved", Value::U64(0)),
                ("budget", Value::U64(budget)),
            ],
        )
    }

    fn points(svg: &str, class: &str) -> Vec<(f64, f64)> {
        let at = svg
            .find(&format!(r#"class="{class}""#))
            .expect("the polyline is drawn");
        let rest = &svg[at..];
        let p = rest.find("points=\"").unwrap() + 8;
        let end = rest[p..].find('"').unwrap();
        rest[p..p + end]
            .split_whitespace()
            .map(|xy| {
                let (x, y) = xy.split_once(',').unwrap();
                (x.parse().unwrap(), y.parse().unwrap())
            })
            .collect()
    }

    #[test]
    fn a_peak_between_two_samples_in_one_pixel_survives_decimation() {
        // 10 000 samples over 1 s: ~10 per pixel column; one spike to the budget.
        let mut r: Vec<Record> = (0..10_000u64)
            .map(|i| ledger(i * 100_000, if i == 5_001 { 100 } else { 10 }, 100))
            .collect();
        r.push(rec(Kind::Instant, 1_000_000_000, "end", Vec::new()));
        let svg = svg(&r);
        let ledger = points(&svg, "ledger");
        let budget = points(&svg, "budget");
        let top = ledger.iter().map(|p| p.1).fold(f64::MAX, f64::min);
        assert!(
            (top - budget[0].1).abs() < 0.05,
            "the spike reaches the budget line"
        );
        assert!(ledger.len() < 6_000, "decimated: {} points", ledger.len());
    }

    #[test]
    fn loads_and_evictions_are_marked_with_their_model_names() {
        let r = vec![
            ledger(0, 0, 100),
            rec(
                Kind::Begin,
                10,
                "load_models_gpu",
                vec![("models", Value::Str("denoiser".into()))],
            ),
            rec(
                Kind::Begin,
                20,
                "evict",
                vec![
                    ("victim", Value::Str("text<encoder>".into())),
                    ("device", Value::Str("sim:0".into())),
                    ("load", Value::Str("denoiser".into())),
                ],
            ),
            rec(Kind::End, 30, "evict", Vec::new()),
            ledger(40, 50, 100),
            rec(Kind::End, 50, "load_models_gpu", Vec::new()),
        ];
        let svg = svg(&r);
        assert!(svg.contains(">denoiser</text>"));
        assert!(svg.contains("✕ text&lt;encoder&gt;"), "names escaped");
        assert!(svg.contains("for the load of denoiser"));
    }
}
