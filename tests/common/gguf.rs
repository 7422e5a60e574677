//! A tiny Llama-architecture GGUF model for the quantized-model tests, written with candle's own
//! GGUF writer, and candle-transformers' `quantized_llama` run on it as the reference.
//!
//! The model: 2 blocks, embedding 256, 4 query heads and 2 key/value heads of 64 dimensions
//! (rope over all 64), feed-forward 512, 64 tokens, an untied output matrix. Its weights mix
//! every GGML type the scheduler must handle: Q4_0, Q8_0, Q4K, Q6K, F16 and F32 (see
//! [`tensor_types`]). Weights are [`residency::float::uniform_tensor`] values (in [-0.5, 0.5)),
//! scaled so activations stay in a sane range; the file is the same bits on every machine.

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use candle_transformers::models::quantized_llama::ModelWeights;

pub const VOCAB: usize = 64;
pub const EMBD: usize = 256;
pub const HEADS: usize = 4;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = EMBD / HEADS;
pub const BLOCKS: usize = 2;
pub const FFN: usize = 512;

/// How a weight's values are made from a uniform [-0.5, 0.5) tensor `u`: `scale * u + offset`.
#[derive(Clone, Copy, Debug)]
struct Init {
    scale: f32,
    offset: f32,
}

/// Matrices: std about 0.014, so a 256-wide product keeps about a quarter of its input's scale
/// and the residual stream dominates (no blow-up over the blocks).
const MATRIX: Init = Init {
    scale: 0.05,
    offset: 0.0,
};
/// The output matrix: larger, so the logits have a real spread (std about 1) and the argmax
/// moves between steps.
const OUTPUT: Init = Init {
    scale: 0.25,
    offset: 0.0,
};
/// Token embeddings: values of order 0.3, like a trained model's after RMS norm scaling.
const EMBEDDING: Init = Init {
    scale: 1.0,
    offset: 0.0,
};
/// RMS-norm gains: 1.0 ± 0.1.
const NORM: Init = Init {
    scale: 0.2,
    offset: 1.0,
};

/// One tensor of the fixture: GGUF name, candle shape (`[out, in]` for matrices), type, init.
type Spec = (String, Vec<usize>, GgmlDType, Init);

/// Every tensor of the fixture with its GGML type, in file order:
///
/// | tensor | shape | type |
/// |---|---|---|
/// | `token_embd.weight` | [64, 256] | Q8_0 |
/// | `output_norm.weight` | [256] | F32 |
/// | `output.weight` | [64, 256] | Q6K |
/// | `blk.N.attn_norm.weight`, `blk.N.ffn_norm.weight` | [256] | F32 |
/// | `blk.0.attn_q.weight` | [256, 256] | Q4_0 |
/// | `blk.1.attn_q.weight` | [256, 256] | F16 |
/// | `blk.N.attn_k.weight` | [128, 256] | Q8_0 |
/// | `blk.N.attn_v.weight` | [128, 256] | Q4K |
/// | `blk.N.attn_output.weight` | [256, 256] | Q6K |
/// | `blk.N.ffn_gate.weight` | [512, 256] | Q4K |
/// | `blk.N.ffn_up.weight` | [512, 256] | Q4_0 |
/// | `blk.N.ffn_down.weight` | [256, 512] | Q8_0 |
///
/// Every row (last candle dimension) is 256 or 512 long: a multiple of the K-quants' 256 block
/// and of Q4_0/Q8_0's 32.
pub fn tensor_types() -> Vec<(String, Vec<usize>, GgmlDType)> {
    specs().into_iter().map(|(n, s, t, _)| (n, s, t)).collect()
}

fn specs() -> Vec<Spec> {
    let kv = KV_HEADS * HEAD_DIM;
    let mut v: Vec<Spec> = vec![
        (
            "token_embd.weight".into(),
            vec![VOCAB, EMBD],
            GgmlDType::Q8_0,
            EMBEDDING,
        ),
        (
            "output_norm.weight".into(),
            vec![EMBD],
            GgmlDType::F32,
            NORM,
        ),
        (
            "output.weight".into(),
            vec![VOCAB, EMBD],
            GgmlDType::Q6K,
            OUTPUT,
        ),
    ];
    for b in 0..BLOCKS {
        let p = format!("blk.{b}");
        let q_type = if b == 1 {
            GgmlDType::F16
        } else {
            GgmlDType::Q4_0
        };
        v.extend([
            (
                format!("{p}.attn_norm.weight"),
                vec![EMBD],
                GgmlDType::F32,
                NORM,
            ),
            (
                format!("{p}.attn_q.weight"),
                vec![EMBD, EMBD],
                q_type,
                MATRIX,
            ),
            (
                format!("{p}.attn_k.weight"),
                vec![kv, EMBD],
                GgmlDType::Q8_0,
                MATRIX,
            ),
            (
                format!("{p}.attn_v.weight"),
                vec![kv, EMBD],
                GgmlDType::Q4K,
                MATRIX,
            ),
            (
                format!("{p}.attn_output.weight"),
                vec![EMBD, EMBD],
                GgmlDType::Q6K,
                MATRIX,
            ),
            (
                format!("{p}.ffn_norm.weight"),
                vec![EMBD],
                GgmlDType::F32,
                NORM,
            ),
            (
                format!("{p}.ffn_gate.weight"),
                vec![FFN, EMBD],
                GgmlDType::Q4K,
                MATRIX,
            ),
            (
                format!("{p}.ffn_up.weight"),
                vec![FFN, EMBD],
                GgmlDType::Q4_0,
                MATRIX,
            ),
            (
                format!("{p}.ffn_down.weight"),
                vec![EMBD, FFN],
                GgmlDType::Q8_0,
                MATRIX,
            ),
        ]);
    }
    v
}

/// The GGUF metadata `quantized_llama::ModelWeights::from_gguf` reads (it needs nothing else:
/// no tokenizer, no `general.alignment`, whose default of 32 is what candle's writer pads to).
fn metadata() -> Vec<(&'static str, gguf_file::Value)> {
    use gguf_file::Value;
    vec![
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("residency-tiny-llama".into())),
        ("llama.attention.head_count", Value::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Value::U32(KV_HEADS as u32)),
        ("llama.block_count", Value::U32(BLOCKS as u32)),
        ("llama.embedding_length", Value::U32(EMBD as u32)),
        ("llama.feed_forward_length", Value::U32(FFN as u32)),
        ("llama.context_length", Value::U32(512)),
        ("llama.vocab_size", Value::U32(VOCAB as u32)),
        ("llama.rope.dimension_count", Value::U32(HEAD_DIM as u32)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
    ]
}

/// The f32 values a fixture tensor is quantized from (seeded by its position in [`specs`]).
fn init_tensor(shape: &[usize], seed: u64, init: Init) -> Tensor {
    let u = residency::float::uniform_tensor(shape, 0x6767_7566 + seed).unwrap();
    u.affine(init.scale as f64, init.offset as f64).unwrap()
}

/// Writes the tiny Llama model to `path` as GGUF (version 2, candle's writer).
pub fn write_tiny_llama(path: &Path) {
    write_llama(path, false)
}

/// [`write_tiny_llama`] without `output.weight`: the head is the token embedding (tied), used
/// at the start and at the end of every forward.
pub fn write_tiny_llama_tied(path: &Path) {
    write_llama(path, true)
}

fn write_llama(path: &Path, tied: bool) {
    let tensors: Vec<(String, QTensor)> = specs()
        .into_iter()
        .filter(|(name, ..)| !(tied && name == "output.weight"))
        .enumerate()
        .map(|(i, (name, shape, dtype, init))| {
            let t = init_tensor(&shape, i as u64, init);
            let q = QTensor::quantize(&t, dtype)
                .unwrap_or_else(|e| panic!("quantizing {name} {shape:?} to {dtype:?}: {e}"));
            (name, q)
        })
        .collect();
    let metadata = metadata();
    let md: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, q)| (k.as_str(), q)).collect();
    let mut w = BufWriter::new(File::create(path).unwrap());
    gguf_file::write(&mut w, &md, &ts).unwrap();
    std::io::Write::flush(&mut w).unwrap();
}

/// Experts of the tiny mixture of experts ([`write_tiny_moe`]).
pub const EXPERTS: usize = 8;
/// Experts each token is routed to.
pub const EXPERTS_USED: usize = 2;
/// Each expert's feed-forward width.
pub const EXPERT_FFN: usize = 256;

/// The tiny Llama with every block's feed-forward replaced by a mixture of [`EXPERTS`] experts,
/// [`EXPERTS_USED`] per token, in the one-tensor-per-expert layout candle-transformers'
/// `quantized_llama` reads (Mixtral's: `blk.N.ffn_gate_inp.weight`, `blk.N.ffn_gate.E.weight`,
/// `ffn_up.E`, `ffn_down.E`). The router's rows are scaled by `1 + e/2` for expert `e`, so its
/// logits for the later experts spread wider and routing is skewed, as trained routers are.
pub fn write_tiny_moe(path: &Path) {
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (i, (name, shape, dtype, init)) in specs().into_iter().enumerate() {
        if name.contains(".ffn_gate.") || name.contains(".ffn_up.") || name.contains(".ffn_down.") {
            continue;
        }
        let t = init_tensor(&shape, i as u64, init);
        tensors.push((name, QTensor::quantize(&t, dtype).unwrap()));
    }
    for b in 0..BLOCKS {
        let p = format!("blk.{b}");
        let seed = 1000 + 100 * b as u64;
        let skew: Vec<f32> = (0..EXPERTS).map(|e| 1.0 + e as f32 / 2.0).collect();
        let skew = Tensor::from_vec(skew, (EXPERTS, 1), &Device::Cpu).unwrap();
        let router = init_tensor(&[EXPERTS, EMBD], seed, OUTPUT)
            .broadcast_mul(&skew)
            .unwrap();
        tensors.push((
            format!("{p}.ffn_gate_inp.weight"),
            QTensor::quantize(&router, GgmlDType::F32).unwrap(),
        ));
        for e in 0..EXPERTS {
            let s = seed + 1 + 3 * e as u64;
            let (gate_t, up_t) = if e % 2 == 0 {
                (GgmlDType::Q4K, GgmlDType::Q4_0)
            } else {
                (GgmlDType::Q8_0, GgmlDType::Q4K)
            };
            let mats = [
                ("ffn_gate", vec![EXPERT_FFN, EMBD], gate_t),
                ("ffn_up", vec![EXPERT_FFN, EMBD], up_t),
                ("ffn_down", vec![EMBD, EXPERT_FFN], GgmlDType::Q8_0),
            ];
            for (j, (name, shape, dtype)) in mats.into_iter().enumerate() {
                let t = init_tensor(&shape, s + j as u64, MATRIX);
                tensors.push((
                    format!("{p}.{name}.{e}.weight"),
                    QTensor::quantize(&t, dtype).unwrap(),
                ));
            }
        }
    }
    let mut metadata = metadata();
    metadata.push(("llama.expert_count", gguf_file::Value::U32(EXPERTS as u32)));
    metadata.push((
        "llama.expert_used_count",
        gguf_file::Value::U32(EXPERTS_USED as u32),
    ));
    let md: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, q)| (k.as_str(), q)).collect();
    let mut w = BufWriter::new(File::create(path).unwrap());
    gguf_file::write(&mut w, &md, &ts).unwrap();
    std::io::Write::flush(&mut w).unwrap();
}

/// The index of the largest value (the first one on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// candle-transformers' `quantized_llama` on the GGUF file at `path`, on the CPU: the prompt in
/// one call at position 0, then `steps` single-token calls on the KV cache, each fed the argmax
/// of the previous call's logits. Returns every call's logits (the last position's, `VOCAB`
/// values each): `steps + 1` vectors.
pub fn reference_logits(path: &Path, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let device = Device::Cpu;
    let mut file = File::open(path).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut model = ModelWeights::from_gguf(content, &mut file, &device).unwrap();
    let logits_of = |t: Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1::<f32>().unwrap() };

    let mut out = Vec::with_capacity(steps + 1);
    let input = Tensor::new(prompt, &device).unwrap().unsqueeze(0).unwrap();
    out.push(logits_of(model.forward(&input, 0).unwrap()));
    for step in 0..steps {
        let next = argmax(out.last().unwrap());
        let input = Tensor::new(&[next], &device).unwrap().unsqueeze(0).unwrap();
        out.push(logits_of(
            model.forward(&input, prompt.len() + step).unwrap(),
        ));
    }
    out
}

/// The greedy tokens of [`reference_logits`]: the argmax of each call's logits.
pub fn greedy_tokens(path: &Path, prompt: &[u32], steps: usize) -> Vec<u32> {
    reference_logits(path, prompt, steps)
        .iter()
        .map(|l| argmax(l))
        .collect()
}

/// A tiny Qwen3-MoE (`general.architecture = qwen3moe`) in the *stacked* layout
/// candle-transformers' `quantized_qwen3_moe` reads: each block's experts in three tensors
/// `blk.N.ffn_gate_exps.weight` / `ffn_up_exps` `[EXPERTS, EXPERT_FFN, EMBD]` and
/// `ffn_down_exps` `[EXPERTS, EMBD, EXPERT_FFN]` (Q4K, Q8_0 and Q6K; block 1 swaps gate and up
/// to Q8_0 / Q4K), an F32 router `ffn_gate_inp` skewed as [`write_tiny_moe`]'s, per-head q/k
/// RMS norms, and the tiny Llama's attention, embedding and head otherwise.
pub fn write_tiny_qwen3_moe(path: &Path) {
    write_qwen3_moe_with_expert_ffn(path, EXPERT_FFN);
}

/// [`write_tiny_qwen3_moe`] with experts `expert_ffn` wide (a multiple of 256) instead of
/// [`EXPERT_FFN`]: the same model otherwise, its experts' bytes scaled (4096 makes each expert
/// matrix 1 Mi values, near a Qwen3-30B-A3B expert matrix's 1.5 Mi), for measuring where an
/// expert's arithmetic, not the calls around it, is the cost.
pub fn write_qwen3_moe_with_expert_ffn(path: &Path, expert_ffn: usize) {
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for (i, (name, shape, dtype, init)) in specs().into_iter().enumerate() {
        if name.contains(".ffn_gate.") || name.contains(".ffn_up.") || name.contains(".ffn_down.") {
            continue;
        }
        let t = init_tensor(&shape, i as u64, init);
        tensors.push((name, QTensor::quantize(&t, dtype).unwrap()));
    }
    for b in 0..BLOCKS {
        let p = format!("blk.{b}");
        let seed = 5000 + 100 * b as u64;
        for (j, norm) in ["attn_q_norm", "attn_k_norm"].into_iter().enumerate() {
            let t = init_tensor(&[HEAD_DIM], seed + 90 + j as u64, NORM);
            tensors.push((
                format!("{p}.{norm}.weight"),
                QTensor::quantize(&t, GgmlDType::F32).unwrap(),
            ));
        }
        let skew: Vec<f32> = (0..EXPERTS).map(|e| 1.0 + e as f32 / 2.0).collect();
        let skew = Tensor::from_vec(skew, (EXPERTS, 1), &Device::Cpu).unwrap();
        let router = init_tensor(&[EXPERTS, EMBD], seed, OUTPUT)
            .broadcast_mul(&skew)
            .unwrap();
        tensors.push((
            format!("{p}.ffn_gate_inp.weight"),
            QTensor::quantize(&router, GgmlDType::F32).unwrap(),
        ));
        let (gate_t, up_t) = if b == 0 {
            (GgmlDType::Q4K, GgmlDType::Q8_0)
        } else {
            (GgmlDType::Q8_0, GgmlDType::Q4K)
        };
        let mats = [
            ("ffn_gate_exps", [EXPERTS, expert_ffn, EMBD], gate_t),
            ("ffn_up_exps", [EXPERTS, expert_ffn, EMBD], up_t),
            ("ffn_down_exps", [EXPERTS, EMBD, expert_ffn], GgmlDType::Q6K),
        ];
        for (j, (name, shape, dtype)) in mats.into_iter().enumerate() {
            let t = init_tensor(&shape, seed + 1 + j as u64, MATRIX);
            tensors.push((
                format!("{p}.{name}.weight"),
                QTensor::quantize(&t, dtype).unwrap(),
            ));
        }
    }
    use gguf_file::Value;
    let metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("qwen3moe".into())),
        (
            "general.name",
            Value::String("residency-tiny-qwen3moe".into()),
        ),
        ("qwen3moe.attention.head_count", Value::U32(HEADS as u32)),
        (
            "qwen3moe.attention.head_count_kv",
            Value::U32(KV_HEADS as u32),
        ),
        ("qwen3moe.attention.key_length", Value::U32(HEAD_DIM as u32)),
        ("qwen3moe.block_count", Value::U32(BLOCKS as u32)),
        ("qwen3moe.embedding_length", Value::U32(EMBD as u32)),
        ("qwen3moe.context_length", Value::U32(512)),
        (
            "qwen3moe.attention.layer_norm_rms_epsilon",
            Value::F32(1e-6),
        ),
        ("qwen3moe.rope.freq_base", Value::F32(1_000_000.0)),
        (
            "qwen3moe.expert_feed_forward_length",
            Value::U32(expert_ffn as u32),
        ),
        ("qwen3moe.expert_count", Value::U32(EXPERTS as u32)),
        (
            "qwen3moe.expert_used_count",
            Value::U32(EXPERTS_USED as u32),
        ),
    ];
    let md: Vec<(&str, &gguf_file::Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, q)| (k.as_str(), q)).collect();
    let mut w = BufWriter::new(File::create(path).unwrap());
    gguf_file::write(&mut w, &md, &ts).unwrap();
    std::io::Write::flush(&mut w).unwrap();
}
