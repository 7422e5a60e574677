//! What a pipeline run reports: per prompt its checksum and timing, per model its resident,
//! streaming and moved bytes, the evictions and the transfer counters; as a table for people and
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
    pub denoiser_moved: ByteSize,
}

/// The whole run.
#[derive(Debug, Clone)]
pub struct PipelineReport {
    pub prompts: Vec<PromptResult>,
    pub budget: ByteSize,
    pub peak: ByteSize,
    pub models: Vec<(String, ByteSize, ByteSize, ByteSize)>,
    pub evictions: Vec<Eviction>,
    pub transfers: residency::offload::TransferSnapshot,
    pub host: residency::weights::HostStats,
    pub memory: String,
    pub total_ms: f64,
}

fn json_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| match c {
            '"' => vec!['\\', '"'],
            '\\' => vec!['\\', '\\'],
            '\n' => vec!['\\', 'n'],
            c if (c as u32) < 0x20 => format!("\\u{:04x}", c as u32).chars().collect(),
            c => vec![c],
        })
        .collect()
}

/// The report as JSON.
pub fn to_json(r: &PipelineReport) -> String {
    let prompts: Vec<String> = r
        .prompts
        .iter()
        .map(|p| {
            format!(
                "{{\"prompt\":\"{}\",\"lora\":{},\"checksum\":\"{:08x}\",\"step_ms\":{:.3},\"denoiser_moved_bytes\":{}}}",
                json_escape(&p.prompt),
                p.lora,
                p.checksum,
                p.step_ms,
                p.denoiser_moved.bytes()
            )
        })
        .collect();
    let models: Vec<String> = r
        .models
        .iter()
        .map(|(n, res, st, mv)| {
            format!(
                "{{\"name\":\"{}\",\"resident_bytes\":{},\"streaming_bytes\":{},\"moved_bytes\":{}}}",
                json_escape(n),
                res.bytes(),
                st.bytes(),
                mv.bytes()
            )
        })
        .collect();
    let evictions: Vec<String> = r
        .evictions
        .iter()
        .map(|e| {
            format!(
                "{{\"model\":\"{}\",\"device\":\"{}\",\"freed_bytes\":{},\"fully\":{},\"reason\":\"{}\"}}",
                json_escape(&e.name),
                e.device,
                e.freed.bytes(),
                e.fully,
                json_escape(&e.reason())
            )
        })
        .collect();
    let t = &r.transfers;
    let h = &r.host;
    let host = format!(
        "{{\"budget_bytes\":{},\"peak_bytes\":{},\"held_bytes\":{},\"reads\":{},\"bytes_read\":{},\"hits\":{},\"evictions\":{},\"pinned_bytes\":{}}}",
        h.budget.map_or_else(|| "null".to_string(), |b| b.bytes().to_string()),
        h.peak.bytes(),
        h.ledger.bytes(),
        h.reads,
        h.bytes_read.bytes(),
        h.hits,
        h.evictions,
        h.pinned.bytes()
    );
    format!(
        "{{\"budget_bytes\":{},\"peak_ledger_bytes\":{},\"total_ms\":{:.1},\"prompts\":[{}],\"models\":[{}],\"evictions\":[{}],\"host\":{},\"transfers\":{{\"bytes\":{},\"staged_bytes\":{},\"fetches\":{},\"prefetch_hits\":{},\"prefetch_misses\":{},\"wait_ms\":{:.3}}}}}",
        r.budget.bytes(),
        r.peak.bytes(),
        r.total_ms,
        prompts.join(","),
        models.join(","),
        evictions.join(","),
        host,
        t.bytes_transferred.bytes(),
        t.bytes_staged.bytes(),
        t.fetches,
        t.prefetch_hits,
        t.prefetch_misses,
        t.wait_ns as f64 / 1e6
    )
}

/// The report as a table for people.
pub fn to_table(r: &PipelineReport) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "{:<14} {:>12} {:>12} {:>12}\n",
        "model", "resident", "streaming", "moved"
    ));
    for (n, res, st, mv) in &r.models {
        s.push_str(&format!(
            "{:<14} {:>12} {:>12} {:>12}\n",
            n,
            res.to_string(),
            st.to_string(),
            mv.to_string()
        ));
    }
    s.push_str(&format!("peak ledger {} of budget {}\n", r.peak, r.budget));
    if let Some(b) = r.host.budget {
        s.push_str(&format!(
            "host: peak {} of budget {}, {} reads ({}), {} hits, {} evictions\n",
            r.host.peak, b, r.host.reads, r.host.bytes_read, r.host.hits, r.host.evictions
        ));
    }
    for p in &r.prompts {
        s.push_str(&format!(
            "prompt {:<38} lora {:<5} checksum {:08x}  {:.1} ms/step  denoiser moved {}\n",
            format!("\"{}\"", p.prompt),
            p.lora,
            p.checksum,
            p.step_ms,
            p.denoiser_moved
        ));
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
    let t = &r.transfers;
    s.push_str(&format!(
        "transfers: {} streamed, prefetch {} hits / {} misses, {:.1} ms waiting; total {:.0} ms\n",
        t.bytes_transferred,
        t.prefetch_hits,
        t.prefetch_misses,
        t.wait_ns as f64 / 1e6,
        r.total_ms
    ));
    s
}
