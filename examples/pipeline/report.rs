//! What a pipeline run reports: per prompt its checksum and timing, per model its resident,
//! streaming and built bytes, the evictions and the transfer counters; as a table for people and
//! as JSON for programs.

use residency::loader::Eviction;
use residency::ByteSize;

/// What one prompt produced.
#[derive(Debug, Clone)]
pub struct PromptResult {
    pub prompt: String,
    pub lora: bool,
    pub checksum: u32,
    pub step_ms: f64,
    pub denoiser_built: ByteSize,
    /// The denoiser's last step beside the cost model's prediction for it.
    pub audit: Option<residency::loader::StepAudit>,
}

/// One model of the run.
#[derive(Debug, Clone)]
pub struct ModelRow {
    pub name: String,
    pub format: String,
    pub resident: ByteSize,
    pub streaming: ByteSize,
    pub built: ByteSize,
}

/// What a model is stored as: `GGUF Q4_K+Q6_K` (its quantized types; `+f32` when some weights
/// are not quantized) or the safetensors storage dtypes (`safetensors bf16`).
pub fn format_of(model: &residency::Model) -> String {
    let mut kinds: Vec<String> = model
        .slots()
        .iter()
        .map(|s| match s.quantized() {
            Some(q) => format!("{q:?}"),
            None => s.dtype().to_string(),
        })
        .collect();
    kinds.sort();
    kinds.dedup();
    let container = if model.gguf_metadata().is_some() {
        "GGUF"
    } else {
        "safetensors"
    };
    format!("{container} {}", kinds.join("+"))
}

/// The whole run.
#[derive(Debug, Clone)]
pub struct PipelineReport {
    pub prompts: Vec<PromptResult>,
    pub budget: ByteSize,
    pub peak: ByteSize,
    /// Per model: name, format (GGUF and its quantized types, or the safetensors dtypes),
    /// resident, streaming and built bytes (resident copies loads made).
    pub models: Vec<ModelRow>,
    pub evictions: Vec<Eviction>,
    pub transfers: residency::offload::TransferSnapshot,
    /// Per simulated GPU: its name, spec and what it did.
    pub sims: Vec<(String, String, residency::device::SimStats)>,
    /// The simulated GPUs' checker findings, described (empty when clean).
    pub findings: Vec<String>,
    pub host: residency::weights::HostStats,
    /// Each reservation the run took (`MemoryManager::reserve_named`) and its largest size.
    pub reservations: Vec<(String, ByteSize)>,
    /// Activations moved between devices by split models (`--device-map`).
    pub split: residency::patcher::SplitStats,
    /// Every GPU beside the compute device when there are several: name, peak ledger, budget.
    pub other_devices: Vec<(String, ByteSize, ByteSize)>,
    /// Residency by use (dynamic mode): per device its hits, misses, faults-in and the offline
    /// optimum for the same uses; `None` in classic mode.
    pub dynamic: Option<Vec<residency::loader::DynamicDeviceReport>>,
    pub memory: String,
    pub total_ms: f64,
}

/// The JSON form of a run: plain numbers, the library's own serde forms for evictions and
/// transfer counters.
#[derive(serde::Serialize)]
struct Json<'a> {
    budget_bytes: u64,
    peak_ledger_bytes: u64,
    total_ms: f64,
    prompts: Vec<JsonPrompt<'a>>,
    models: Vec<JsonModel<'a>>,
    evictions: &'a [Eviction],
    host: JsonHost,
    transfers: &'a residency::offload::TransferSnapshot,
    sims: Vec<JsonSim<'a>>,
    reservations: Vec<JsonReservation<'a>>,
    split: &'a residency::patcher::SplitStats,
    /// `"dynamic"` (residency by use) or `"classic"`.
    mode: &'static str,
    dynamic: &'a Option<Vec<residency::loader::DynamicDeviceReport>>,
}

/// A reservation the run took: its name and largest size.
#[derive(serde::Serialize)]
struct JsonReservation<'a> {
    name: &'a str,
    peak_bytes: u64,
}

/// A simulated GPU: its copies, how long compute waited for them, the checker's findings.
#[derive(serde::Serialize)]
struct JsonSim<'a> {
    device: &'a str,
    spec: &'a str,
    stats: &'a residency::device::SimStats,
    hidden: f64,
}

/// The host tier (`--ram-budget`): `budget_bytes` is null without a budget.
#[derive(serde::Serialize)]
struct JsonHost {
    budget_bytes: Option<u64>,
    peak_bytes: u64,
    held_bytes: u64,
    reads: u64,
    bytes_read: u64,
    hits: u64,
    evictions: u64,
    pinned_bytes: u64,
}

#[derive(serde::Serialize)]
struct JsonPrompt<'a> {
    prompt: &'a str,
    lora: bool,
    checksum: String,
    step_ms: f64,
    denoiser_built_bytes: u64,
    /// The denoiser's last step: predicted and measured time (ms) and bytes copied.
    last_step_predicted_ms: Option<f64>,
    last_step_measured_ms: Option<f64>,
    last_step_predicted_bytes: Option<u64>,
    last_step_measured_bytes: Option<u64>,
}

#[derive(serde::Serialize)]
struct JsonModel<'a> {
    name: &'a str,
    format: &'a str,
    resident_bytes: u64,
    streaming_bytes: u64,
    built_bytes: u64,
}

/// The report as JSON.
pub fn to_json(r: &PipelineReport) -> String {
    let json = Json {
        budget_bytes: r.budget.bytes(),
        peak_ledger_bytes: r.peak.bytes(),
        total_ms: r.total_ms,
        prompts: r
            .prompts
            .iter()
            .map(|p| JsonPrompt {
                prompt: &p.prompt,
                lora: p.lora,
                checksum: format!("{:08x}", p.checksum),
                step_ms: p.step_ms,
                denoiser_built_bytes: p.denoiser_built.bytes(),
                last_step_predicted_ms: p.audit.as_ref().map(|a| a.predicted.step_ns as f64 / 1e6),
                last_step_measured_ms: p.audit.as_ref().map(|a| a.measured_ns as f64 / 1e6),
                last_step_predicted_bytes: p.audit.as_ref().map(|a| a.predicted.bytes.bytes()),
                last_step_measured_bytes: p.audit.as_ref().map(|a| a.measured_bytes.bytes()),
            })
            .collect(),
        models: r
            .models
            .iter()
            .map(|m| JsonModel {
                name: &m.name,
                format: &m.format,
                resident_bytes: m.resident.bytes(),
                streaming_bytes: m.streaming.bytes(),
                built_bytes: m.built.bytes(),
            })
            .collect(),
        evictions: &r.evictions,
        host: JsonHost {
            budget_bytes: r.host.budget.map(|b| b.bytes()),
            peak_bytes: r.host.peak.bytes(),
            held_bytes: r.host.ledger.bytes(),
            reads: r.host.reads,
            bytes_read: r.host.bytes_read.bytes(),
            hits: r.host.hits,
            evictions: r.host.evictions,
            pinned_bytes: r.host.pinned.bytes(),
        },
        transfers: &r.transfers,
        mode: if r.dynamic.is_some() {
            "dynamic"
        } else {
            "classic"
        },
        dynamic: &r.dynamic,
        sims: r
            .sims
            .iter()
            .map(|(device, spec, stats)| JsonSim {
                device,
                spec,
                stats,
                hidden: stats.hidden(),
            })
            .collect(),
        reservations: r
            .reservations
            .iter()
            .map(|(name, peak)| JsonReservation {
                name,
                peak_bytes: peak.bytes(),
            })
            .collect(),
        split: &r.split,
    };
    serde_json::to_string(&json).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
}

/// The report as a table for people.
pub fn to_table(r: &PipelineReport) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "{:<14} {:<22} {:>12} {:>12} {:>12}\n",
        "model", "format", "resident", "streaming", "built"
    ));
    for m in &r.models {
        s.push_str(&format!(
            "{:<14} {:<22} {:>12} {:>12} {:>12}\n",
            m.name,
            m.format,
            m.resident.to_string(),
            m.streaming.to_string(),
            m.built.to_string()
        ));
    }
    s.push_str(&format!("peak ledger {} of budget {}\n", r.peak, r.budget));
    for (name, peak, budget) in &r.other_devices {
        s.push_str(&format!("peak ledger {name} {peak} of budget {budget}\n"));
    }
    if r.split.activation_moves > 0 {
        s.push_str(&format!(
            "split: {} activation copies between devices ({})\n",
            r.split.activation_moves, r.split.activation_bytes
        ));
    }
    for (name, peak) in &r.reservations {
        s.push_str(&format!("reservation {name}: up to {peak}\n"));
    }
    if let Some(b) = r.host.budget {
        s.push_str(&format!(
            "host: peak {} of budget {}, {} reads ({}), {} hits, {} evictions\n",
            r.host.peak, b, r.host.reads, r.host.bytes_read, r.host.hits, r.host.evictions
        ));
    }
    for p in &r.prompts {
        s.push_str(&format!(
            "prompt {:<38} lora {:<5} checksum {:08x}  {:.1} ms/step  denoiser built {}\n",
            format!("\"{}\"", p.prompt),
            p.lora,
            p.checksum,
            p.step_ms,
            p.denoiser_built
        ));
        if let Some(a) = &p.audit {
            s.push_str(&format!("  denoiser's last step {a}\n"));
        }
    }
    s.push_str(&format!("{} evictions", r.evictions.len()));
    if let Some(e) = r.evictions.first() {
        s.push_str(&format!(
            " (first: {} freed {} because {})",
            e.name,
            e.freed,
            e.reason()
        ));
    }
    s.push('\n');
    match &r.dynamic {
        None => s.push_str("residency: classic (resident sets decided at load)\n"),
        Some(devices) => {
            s.push_str("residency: dynamic (by use: weights kept as forwards use them)\n");
            for d in devices {
                s.push_str(&format!("  {d}\n"));
            }
        }
    }
    let t = &r.transfers;
    s.push_str(&format!(
        "transfers: {} streamed, prefetch {} hits / {} misses, {:.1} ms waiting; total {:.0} ms\n",
        t.bytes_transferred,
        t.prefetch_hits,
        t.prefetch_misses,
        t.wait_ns as f64 / 1e6,
        r.total_ms
    ));
    for (device, spec, st) in &r.sims {
        s.push_str(&format!(
            "{device} (simulated, {spec}): {} copies, {}, {:.1} ms copying, compute waited {:.1} ms: {:.0} % of copy time hidden behind compute; checker: {}\n",
            st.copies,
            st.bytes,
            st.copy_ns as f64 / 1e6,
            st.compute_waited_ns as f64 / 1e6,
            st.hidden() * 100.0,
            if st.violations == 0 { "clean".to_string() } else { format!("{} findings", st.violations) },
        ));
    }
    for f in &r.findings {
        s.push_str(&format!(
            "  checker finding: {f}
"
        ));
    }
    s
}
