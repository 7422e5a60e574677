//! What a run did, over time: a [`tracing_subscriber::Layer`] that records residency's spans and
//! ledger counters, and writes them as a Chrome trace (Perfetto, `chrome://tracing`) or draws
//! them as a timeline picture ([`Trace::timeline_svg`], `timeline.rs`).
//!
//! **What residency emits** (docs/ARCHITECTURE.md §12). Spans, at `debug` unless said: a load
//! (`load_models_gpu`, `info`, with its `plan` and `execute` children: the models, each model's
//! weight budget, the bytes to move and to evict, the ledger after), each eviction (`evict`:
//! victim, device, bytes, and the reason — the load that needed the room, how much it needed and
//! how much was free), each weight copy on a simulated GPU (`copy`: device, stream, bytes, and the
//! source — `pinned_in_place`, `staged` or `pageable`; the span runs on the stream's worker while
//! the copy *executes*, not while it is enqueued), each wait of compute on a copy (`copy_wait`)
//! and on a lane (`lane_wait`), each weight a lane or an inline fetch builds (`transfer`, with the
//! `source` its copy took, on every backend), and host-tier reads (`host_read`). Events: prefetch
//! `hit` / `miss`, host-tier `host_evict`, cast-cache `cast_kept` / `cast_dropped` /
//! `cast_refused`, the attention backend chosen (`attention`). CUDA copies have no `copy` span:
//! covering their execution would need timed events read back after the fact.
//!
//! **Counters** are events of target [`COUNTER_TARGET`] with a `counter` field naming the series
//! (`ledger`, `host`), a `device` field for a device ledger, and numeric columns: a device ledger
//! reports `resident`, `in_flight`, `cached`, `reserved` and `budget` (0 when unbounded) each time
//! its book changes (`loader/ledger.rs`), the host tier `held`, `reading` and `budget`
//! (`weights/host.rs`). Each is emitted after the book's lock is released, and only when some
//! subscriber wants it (`tracing::enabled!`), so with nobody listening a change costs one
//! interest check.
//!
//! **Recording.** A [`Trace`] is the recording; [`Trace::layer`] is the layer to add to a
//! `tracing_subscriber` registry (`registry().with(trace.layer())`), or [`Trace::install_global`]
//! does that as the global default in one call. It must be global (or installed on every thread)
//! to see the copies, which run on the simulated GPU's stream workers, and the lanes. Each
//! thread is a track; its records are appended under one lock with the timestamp taken inside it,
//! so on every track the records are in time order and every begin has its end (a span enters and
//! exits on the same thread). Span fields recorded after entry are written on the end record
//! (viewers merge a slice's begin and end arguments).
//!
//! **The Chrome file** ([`Trace::chrome_json`]): the JSON object format of the trace-event spec —
//! `B`/`E` per span entry and exit, `i` per event, `C` per counter sample, `M` metadata naming the
//! processes and threads. Process 1 is the host (the calling threads, lanes, the host tier's
//! counter); each device is a process of its own holding its ledger counter and its streams'
//! tracks (a simulated stream's worker thread is named `residency-<device>-stream<n>`). Times are
//! microseconds since the trace began.
//!
//! Examples take `--trace FILE` (and candle's `--tracing`, which writes `trace-<seconds>.json`)
//! and `--timeline FILE` through [`TraceArgs`].
//!
//! Lock: `Trace`'s record list is a leaf, taken by whichever thread emits, below every lock of the
//! crate's table (an event can be emitted under any of them); nothing is called while it is held
//! but the writers of this module, which also take the leaf list of thread names (never the other
//! way round).

mod args;
mod timeline;

pub use args::{TraceArgs, TraceSession};

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::lock::{Mutex, Rank};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record as SpanRecord};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// The target of counter events (ledger samples), which the layer writes as counter tracks.
pub const COUNTER_TARGET: &str = "residency::counter";

/// A field value as recorded.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// An unsigned integer (bytes, counts).
    U64(u64),
    /// A signed integer.
    I64(i64),
    /// A float.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// Text (strings, and `Display` / `Debug` values).
    Str(String),
}

impl Value {
    /// The value as a number, if it is one.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::U64(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The value as text (numbers printed).
    pub fn text(&self) -> String {
        match self {
            Value::U64(v) => v.to_string(),
            Value::I64(v) => v.to_string(),
            Value::F64(v) => v.to_string(),
            Value::Bool(v) => v.to_string(),
            Value::Str(s) => s.clone(),
        }
    }

    fn write_json(&self, out: &mut String) {
        match self {
            Value::U64(v) => {
                let _ = write!(out, "{v}");
            }
            Value::I64(v) => {
                let _ = write!(out, "{v}");
            }
            Value::F64(v) if v.is_finite() => {
                let _ = write!(out, "{v}");
            }
            Value::F64(_) => out.push_str("null"),
            Value::Bool(v) => {
                let _ = write!(out, "{v}");
            }
            Value::Str(s) => quote(out, s),
        }
    }
}

/// Named field values.
pub type Fields = Vec<(&'static str, Value)>;

/// What happened at one moment on one track.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// A span was entered.
    Begin,
    /// A span was exited.
    End,
    /// An event.
    Instant,
    /// A counter sample: `name` is the series (`ledger sim:0`, `host`), the fields its columns.
    Counter,
}

/// One record of a [`Trace`].
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// What it is.
    pub kind: Kind,
    /// Nanoseconds since the trace began.
    pub ts_ns: u64,
    /// The thread it happened on (see [`Trace::track_name`]).
    pub track: u32,
    /// The span's or event's name (an event's message when it has one); a counter's series.
    pub name: Cow<'static, str>,
    /// The target (module path) of its callsite.
    pub target: &'static str,
    /// Its fields (for an end: those recorded after the span was first entered).
    pub fields: Fields,
}

impl Record {
    /// The field named `name`.
    pub fn field(&self, name: &str) -> Option<&Value> {
        self.fields.iter().find(|(k, _)| *k == name).map(|(_, v)| v)
    }

    /// The field named `name` as a number.
    pub fn number(&self, name: &str) -> Option<f64> {
        self.field(name).and_then(Value::as_f64)
    }
}

static NEXT_TRACK: AtomicU32 = AtomicU32::new(1);
static TRACK_NAMES: Mutex<Vec<(u32, String)>> = Mutex::new(Rank::TrackNames, Vec::new());

thread_local! {
    static TRACK: Cell<u32> = const { Cell::new(0) };
}

/// This thread's track number (numbered, and named after the thread, at first use).
fn current_track() -> u32 {
    TRACK.with(|t| {
        if t.get() == 0 {
            let id = NEXT_TRACK.fetch_add(1, Ordering::Relaxed);
            let thread = std::thread::current();
            let name = thread
                .name()
                .map(str::to_string)
                .unwrap_or_else(|| format!("thread {id}"));
            TRACK_NAMES.lock().push((id, name));
            t.set(id);
        }
        t.get()
    })
}

struct Shared {
    start: Instant,
    records: Mutex<Vec<Record>>,
    /// The managers whose ledgers this recording saw, in order: the first one's series are
    /// `ledger sim:0`, the second's `ledger sim:0 (manager 2)`.
    managers: Mutex<Vec<u64>>,
}

/// A recording of residency's spans, events and counters (see the module docs). Clones share it.
#[derive(Clone)]
pub struct Trace {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Trace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trace")
            .field("records", &self.shared.records.lock().len())
            .finish()
    }
}

impl Default for Trace {
    fn default() -> Self {
        Trace::new()
    }
}

impl Trace {
    /// An empty recording; time 0 is now.
    pub fn new() -> Trace {
        Trace {
            shared: Arc::new(Shared {
                start: Instant::now(),
                records: Mutex::new(Rank::Trace, Vec::new()),
                managers: Mutex::new(Rank::Trace, Vec::new()),
            }),
        }
    }

    /// The layer that records into this trace, to add to a `tracing_subscriber` registry.
    pub fn layer(&self) -> TraceLayer {
        TraceLayer {
            trace: self.clone(),
        }
    }

    /// Makes a registry with this trace's layer the process's global default subscriber.
    ///
    /// # Errors
    /// When a global default is set already (add [`Trace::layer`] to that one instead).
    pub fn install_global(&self) -> Result<(), tracing::subscriber::SetGlobalDefaultError> {
        use tracing_subscriber::layer::SubscriberExt;
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(self.layer()))
    }

    /// Every record so far, in the order they were taken (time order).
    pub fn records(&self) -> Vec<Record> {
        self.shared.records.lock().clone()
    }

    /// Forgets every record so far (time 0 stays where it was).
    pub fn clear(&self) {
        self.shared.records.lock().clear();
    }

    /// The name of a track: its thread's name, or `thread N`.
    pub fn track_name(track: u32) -> String {
        TRACK_NAMES
            .lock()
            .iter()
            .find(|(id, _)| *id == track)
            .map(|(_, n)| n.clone())
            .unwrap_or_else(|| format!("thread {track}"))
    }

    /// The 1-based order in which this recording first saw manager `id`'s ledger (taken and
    /// released before the records' lock).
    fn manager_ordinal(&self, id: u64) -> usize {
        let mut seen = self.shared.managers.lock();
        match seen.iter().position(|&m| m == id) {
            Some(i) => i + 1,
            None => {
                seen.push(id);
                seen.len()
            }
        }
    }

    fn push(&self, kind: Kind, name: Cow<'static, str>, target: &'static str, fields: Fields) {
        let track = current_track();
        let mut records = self.shared.records.lock();
        // Taken under the lock: the list is in time order on every track.
        let ts_ns = self.shared.start.elapsed().as_nanos() as u64;
        records.push(Record {
            kind,
            ts_ns,
            track,
            name,
            target,
            fields,
        });
    }

    /// The trace as Chrome trace-event JSON (see the module docs for the layout). Threads that
    /// emit meanwhile wait until it is written (the records are not copied).
    pub fn chrome_json(&self) -> String {
        chrome_json(&self.shared.records.lock())
    }

    /// The run as an SVG picture: per device, the ledger over time against its budget with loads
    /// and evictions marked, and the compute, stream and lane tracks below (`timeline.rs`).
    pub fn timeline_svg(&self) -> String {
        timeline::svg(&self.shared.records.lock())
    }
}

/// The timeline picture of `records` (see [`Trace::timeline_svg`]).
pub fn timeline_svg(records: &[Record]) -> String {
    timeline::svg(records)
}

/// The device a track or counter belongs to, from its name: a simulated stream's worker
/// (`residency-sim:0-stream3`) or a device ledger (`ledger sim:0`).
fn device_of(name: &str) -> Option<&str> {
    if let Some(rest) = name.strip_prefix("residency-") {
        return rest.rsplit_once("-stream").map(|(d, _)| d);
    }
    name.strip_prefix("ledger ")
}

/// A track's name as a trace viewer shows it: `stream 3 (copies)` under its device, `lane 0
/// (transfers)`, other threads by their own names.
fn display_track(name: &str) -> String {
    if let Some(lane) = name.strip_prefix("residency-lane-") {
        return format!("lane {lane} (transfers)");
    }
    match name
        .strip_prefix("residency-")
        .and_then(|rest| rest.rsplit_once("-stream"))
    {
        Some((_, n)) => format!("stream {n} (copies)"),
        None => name.to_string(),
    }
}

/// Chrome trace-event JSON of `records`, written straight into one string (a run of a few
/// seconds has tens of thousands of records; no tree of values is built).
pub fn chrome_json(records: &[Record]) -> String {
    let mut processes: Vec<String> = vec!["host".to_string()];
    let mut pid_of = |device: Option<&str>| -> usize {
        match device {
            None => 1,
            Some(d) => match processes.iter().position(|p| p == d) {
                Some(i) => i + 1,
                None => {
                    processes.push(d.to_string());
                    processes.len()
                }
            },
        }
    };
    let mut tracks: HashMap<u32, (usize, String)> = HashMap::new();
    let mut out = String::with_capacity(records.len() * 160 + 256);
    out.push_str("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[");
    let mut first = true;
    for r in records {
        let pid = match r.kind {
            Kind::Counter => pid_of(device_of(&r.name)),
            _ => {
                tracks
                    .entry(r.track)
                    .or_insert_with(|| {
                        let name = Trace::track_name(r.track);
                        (pid_of(device_of(&name)), name)
                    })
                    .0
            }
        };
        let (ph, tid) = match r.kind {
            Kind::Begin => ("B", r.track),
            Kind::End => ("E", r.track),
            Kind::Instant => ("i", r.track),
            Kind::Counter => ("C", 0),
        };
        open_event(&mut out, &mut first);
        let _ = write!(out, "\"ph\":\"{ph}\",\"name\":");
        quote(&mut out, &r.name);
        if r.kind != Kind::Counter {
            out.push_str(",\"cat\":");
            quote(&mut out, r.target);
        }
        if r.kind == Kind::Instant {
            out.push_str(",\"s\":\"t\"");
        }
        let _ = write!(
            out,
            ",\"ts\":{:.3},\"pid\":{pid},\"tid\":{tid},\"args\":{{",
            r.ts_ns as f64 / 1e3
        );
        let mut first_arg = true;
        for (k, v) in &r.fields {
            // A counter's columns are its numbers; its series and device are in its name.
            if r.kind == Kind::Counter
                && (matches!(*k, "counter" | "device" | "manager") || v.as_f64().is_none())
            {
                continue;
            }
            if !first_arg {
                out.push(',');
            }
            first_arg = false;
            quote(&mut out, k);
            out.push(':');
            v.write_json(&mut out);
        }
        out.push_str("}}");
    }
    for (i, p) in processes.iter().enumerate() {
        let name = if i == 0 {
            "host".to_string()
        } else {
            format!("device {p}")
        };
        metadata(&mut out, &mut first, "process_name", i + 1, 0, &name);
    }
    let mut names: Vec<(&u32, &(usize, String))> = tracks.iter().collect();
    names.sort();
    for (&tid, (pid, name)) in names {
        metadata(
            &mut out,
            &mut first,
            "thread_name",
            *pid,
            tid,
            &display_track(name),
        );
    }
    out.push_str("]}\n");
    out
}

/// Starts an event object in the trace's list.
fn open_event(out: &mut String, first: &mut bool) {
    if !*first {
        out.push(',');
    }
    *first = false;
    out.push_str("\n{");
}

/// A metadata event naming a process or thread.
fn metadata(out: &mut String, first: &mut bool, what: &str, pid: usize, tid: u32, name: &str) {
    open_event(out, first);
    let _ = write!(
        out,
        "\"ph\":\"M\",\"name\":\"{what}\",\"pid\":{pid},\"tid\":{tid},\"args\":{{\"name\":"
    );
    quote(out, name);
    out.push_str("}}");
}

/// `s` as a JSON string.
fn quote(out: &mut String, s: &str) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Records a span's or event's fields.
#[derive(Default)]
struct FieldVisitor {
    fields: Fields,
    message: Option<String>,
}

impl FieldVisitor {
    fn set(&mut self, field: &Field, value: Value) {
        let name = field.name();
        if name == "message" {
            self.message = Some(value.text());
            return;
        }
        match self.fields.iter_mut().find(|(k, _)| *k == name) {
            Some(slot) => slot.1 = value,
            None => self.fields.push((name, value)),
        }
    }
}

impl Visit for FieldVisitor {
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.set(field, Value::U64(value));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.set(field, Value::I64(value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.set(field, Value::F64(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.set(field, Value::Bool(value));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.set(field, Value::Str(value.to_string()));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let mut s = String::new();
        let _ = write!(s, "{value:?}");
        self.set(field, Value::Str(s));
    }
}

/// A span's fields, kept in its extensions: all of them, and those recorded since it was first
/// entered (which its end records carry, as the begin records could not).
struct SpanFields {
    all: Fields,
    entered: bool,
    late: Fields,
}

/// The `tracing_subscriber` layer of a [`Trace`].
pub struct TraceLayer {
    trace: Trace,
}

impl std::fmt::Debug for TraceLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceLayer").finish()
    }
}

impl<S> Layer<S> for TraceLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let mut v = FieldVisitor::default();
        attrs.record(&mut v);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields {
                all: v.fields,
                entered: false,
                late: Vec::new(),
            });
        }
    }

    fn on_record(&self, id: &Id, values: &SpanRecord<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            let mut ext = span.extensions_mut();
            if let Some(fields) = ext.get_mut::<SpanFields>() {
                let mut v = FieldVisitor {
                    fields: std::mem::take(&mut fields.all),
                    message: None,
                };
                values.record(&mut v);
                fields.all = v.fields;
                if fields.entered {
                    let mut v = FieldVisitor {
                        fields: std::mem::take(&mut fields.late),
                        message: None,
                    };
                    values.record(&mut v);
                    fields.late = v.fields;
                }
            }
        }
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            let fields = match span.extensions_mut().get_mut::<SpanFields>() {
                Some(f) => {
                    f.entered = true;
                    f.all.clone()
                }
                None => Vec::new(),
            };
            let meta = span.metadata();
            self.trace.push(
                Kind::Begin,
                Cow::Borrowed(meta.name()),
                meta.target(),
                fields,
            );
        }
    }

    fn on_exit(&self, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            let fields = span
                .extensions()
                .get::<SpanFields>()
                .map(|f| f.late.clone())
                .unwrap_or_default();
            let meta = span.metadata();
            self.trace
                .push(Kind::End, Cow::Borrowed(meta.name()), meta.target(), fields);
        }
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let meta = event.metadata();
        let mut v = FieldVisitor::default();
        event.record(&mut v);
        if meta.target() == COUNTER_TARGET {
            let series = v
                .fields
                .iter()
                .find(|(k, _)| *k == "counter")
                .map(|(_, s)| s.text())
                .unwrap_or_else(|| "counter".into());
            let name = match v.fields.iter().find(|(k, _)| *k == "device") {
                Some((_, d)) => format!("{series} {}", d.text()),
                None => series,
            };
            // A second manager in the process: its devices are series of their own.
            let manager = v
                .fields
                .iter()
                .find(|(k, _)| *k == "manager")
                .and_then(|(_, m)| m.as_f64())
                .map(|m| m as u64);
            let name = match manager.map(|m| self.trace.manager_ordinal(m)) {
                Some(n) if n > 1 => format!("{name} (manager {n})"),
                _ => name,
            };
            self.trace
                .push(Kind::Counter, Cow::Owned(name), meta.target(), v.fields);
            return;
        }
        let name = v.message.map_or(Cow::Borrowed(meta.name()), Cow::Owned);
        self.trace
            .push(Kind::Instant, name, meta.target(), v.fields);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    fn recorded(f: impl FnOnce()) -> Trace {
        let trace = Trace::new();
        let subscriber = tracing_subscriber::registry().with(trace.layer());
        tracing::subscriber::with_default(subscriber, f);
        trace
    }

    #[test]
    fn a_span_becomes_a_begin_and_an_end_with_its_late_fields() {
        let trace = recorded(|| {
            let span = tracing::info_span!("load", models = "a,b", moved = tracing::field::Empty);
            let g = span.enter();
            tracing::info!(bytes = 3u64, "inside");
            span.record("moved", 42u64);
            drop(g);
        });
        let r = trace.records();
        assert_eq!(r.len(), 3);
        assert_eq!(
            (r[0].kind.clone(), r[0].name.as_ref()),
            (Kind::Begin, "load")
        );
        assert_eq!(r[0].field("models"), Some(&Value::Str("a,b".into())));
        assert_eq!(
            (r[1].kind.clone(), r[1].name.as_ref()),
            (Kind::Instant, "inside")
        );
        assert_eq!(r[1].number("bytes"), Some(3.0));
        assert_eq!(r[2].kind, Kind::End);
        assert_eq!(r[2].number("moved"), Some(42.0), "recorded after entry");
        assert!(r.windows(2).all(|w| w[0].ts_ns <= w[1].ts_ns));
    }

    #[test]
    fn counter_events_become_counter_samples_named_by_series_and_device() {
        let trace = recorded(|| {
            tracing::debug!(target: "residency::counter", counter = "ledger", device = "sim:0",
                resident = 10u64, in_flight = 2u64, budget = 100u64);
        });
        let json: serde_json::Value = serde_json::from_str(&trace.chrome_json()).unwrap();
        let events = json["traceEvents"].as_array().unwrap();
        let c = events.iter().find(|e| e["ph"] == "C").unwrap();
        assert_eq!(c["name"], "ledger sim:0");
        assert_eq!(c["args"]["resident"], 10);
        assert!(
            c["args"].get("device").is_none(),
            "only numbers are columns"
        );
        // The device's ledger sits in the device's own process, named so.
        let pid = c["pid"].as_u64().unwrap();
        assert!(pid > 1);
        assert!(events.iter().any(|e| e["ph"] == "M"
            && e["name"] == "process_name"
            && e["pid"] == pid
            && e["args"]["name"] == "device sim:0"));
    }

    #[test]
    fn two_managers_in_one_process_are_two_series() {
        use crate::loader::MemoryManager;
        use crate::vram::{Config, DeviceId, Hardware};
        let managers: Vec<MemoryManager> = (0..2)
            .map(|_| {
                let config =
                    Config::from_args(["--sim-gpu", "1MiB", "--disable-dynamic-vram"]).unwrap();
                MemoryManager::new(config, Hardware::cpu_only(crate::ByteSize::gib(8))).unwrap()
            })
            .collect();
        let trace = recorded(|| {
            for (i, mm) in managers.iter().enumerate() {
                let w = crate::float::uniform_tensor(&[16, 16], i as u64).unwrap();
                let model = crate::weights::Model::from_tensors("m", [("w", w)]).unwrap();
                let p = crate::ModelPatcher::new(model, DeviceId::Sim(0), DeviceId::Cpu);
                mm.load_model_gpu(&p).unwrap();
            }
        });
        let names: std::collections::BTreeSet<String> = trace
            .records()
            .into_iter()
            .filter(|r| r.kind == Kind::Counter)
            .map(|r| r.name.to_string())
            .collect();
        assert!(names.contains("ledger sim:0"), "{names:?}");
        assert!(names.contains("ledger sim:0 (manager 2)"), "{names:?}");
        let json: serde_json::Value = serde_json::from_str(&trace.chrome_json()).unwrap();
        let events = json["traceEvents"].as_array().unwrap();
        assert!(
            events
                .iter()
                .filter(|e| e["ph"] == "C")
                .all(|e| e["args"].get("manager").is_none()),
            "the manager names the series, it is not a column"
        );
    }

    #[test]
    fn names_and_values_are_escaped_into_valid_json() {
        let trace = recorded(|| {
            tracing::info!(
                model = "a \"quoted\"\\ name\n\u{1}",
                ratio = f64::NAN,
                "tab\there"
            );
        });
        let json: serde_json::Value = serde_json::from_str(&trace.chrome_json()).unwrap();
        let e = &json["traceEvents"][0];
        assert_eq!(e["name"], "tab\there");
        assert_eq!(e["args"]["model"], "a \"quoted\"\\ name\n\u{1}");
        assert!(e["args"]["ratio"].is_null(), "NaN is not JSON");
    }

    #[test]
    fn tracks_of_sim_streams_belong_to_their_device() {
        assert_eq!(device_of("residency-sim:1-stream4"), Some("sim:1"));
        assert_eq!(device_of("ledger cuda:0"), Some("cuda:0"));
        assert_eq!(device_of("residency-lane-0"), None);
        assert_eq!(device_of("main"), None);
    }
}
