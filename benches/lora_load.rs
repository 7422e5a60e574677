//! LoRA load time for a Flux-shaped model: a rank-16 LoRA in diffusers/PEFT naming on every
//! linear layer of Flux-dev (hidden 3072, 19 double and 38 single blocks: 502 modules, each q, k,
//! v an offset patch of its fused `qkv` / `linear1`), read from a safetensors file, its names
//! mapped onto BFL's keys and the patches registered on a clone — the key mapping and patch
//! registration a node author's "load LoRA" costs, no weight touched.
//!
//! The model is Flux-dev's real key set and shapes (12 B parameters in bf16) in a sparse file
//! read lazily: only its header is read. Limits measured in the same run: reading the LoRA file's
//! tensors alone (what any loader must do), and one pass over their values (what the value check
//! at registration costs at least).
//!
//! `cargo bench --bench lora_load`.

use std::collections::HashMap;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use criterion::{criterion_group, Criterion};
use residency::patcher::lora_file;
use residency::weights::{save_safetensors, HostTier, Model, SafetensorsOptions};
use residency::{DeviceId, Dtype, ModelPatcher};

const HIDDEN: usize = 3072;
const MLP: usize = 12288;
const DOUBLE: usize = 19;
const SINGLE: usize = 38;
const RANK: usize = 16;
const ROUNDS: usize = 7;

/// BFL's Flux-dev weights (the linear ones LoRAs target, and the embedders), with shapes.
fn flux_shapes() -> Vec<(String, Vec<usize>)> {
    let h = HIDDEN;
    let mut v: Vec<(String, Vec<usize>)> = vec![
        ("img_in.weight".into(), vec![h, 64]),
        ("txt_in.weight".into(), vec![h, 4096]),
        ("time_in.in_layer.weight".into(), vec![h, 256]),
        ("time_in.out_layer.weight".into(), vec![h, h]),
        ("guidance_in.in_layer.weight".into(), vec![h, 256]),
        ("guidance_in.out_layer.weight".into(), vec![h, h]),
        ("vector_in.in_layer.weight".into(), vec![h, 768]),
        ("vector_in.out_layer.weight".into(), vec![h, h]),
        ("final_layer.linear.weight".into(), vec![64, h]),
        (
            "final_layer.adaLN_modulation.1.weight".into(),
            vec![2 * h, h],
        ),
    ];
    for n in 0..DOUBLE {
        for s in ["img", "txt"] {
            let b = format!("double_blocks.{n}.{s}");
            v.push((format!("{b}_mod.lin.weight"), vec![6 * h, h]));
            v.push((format!("{b}_attn.qkv.weight"), vec![3 * h, h]));
            v.push((format!("{b}_attn.proj.weight"), vec![h, h]));
            v.push((format!("{b}_mlp.0.weight"), vec![MLP, h]));
            v.push((format!("{b}_mlp.2.weight"), vec![h, MLP]));
        }
    }
    for n in 0..SINGLE {
        let b = format!("single_blocks.{n}");
        v.push((format!("{b}.linear1.weight"), vec![3 * h + MLP, h]));
        v.push((format!("{b}.linear2.weight"), vec![h, h + MLP]));
        v.push((format!("{b}.modulation.lin.weight"), vec![3 * h, h]));
    }
    v
}

/// The diffusers modules of a LoRA on every linear layer, with `(out, in)`.
fn lora_modules() -> Vec<(String, usize, usize)> {
    let h = HIDDEN;
    let mut v: Vec<(String, usize, usize)> = [
        ("x_embedder", h, 64),
        ("context_embedder", h, 4096),
        ("time_text_embed.timestep_embedder.linear_1", h, 256),
        ("time_text_embed.timestep_embedder.linear_2", h, h),
        ("time_text_embed.guidance_embedder.linear_1", h, 256),
        ("time_text_embed.guidance_embedder.linear_2", h, h),
        ("time_text_embed.text_embedder.linear_1", h, 768),
        ("time_text_embed.text_embedder.linear_2", h, h),
        ("norm_out.linear", 2 * h, h),
        ("proj_out", 64, h),
    ]
    .iter()
    .map(|&(m, o, i)| (m.to_string(), o, i))
    .collect();
    for n in 0..DOUBLE {
        let b = format!("transformer_blocks.{n}");
        for (m, o, i) in [
            ("attn.to_q", h, h),
            ("attn.to_k", h, h),
            ("attn.to_v", h, h),
            ("attn.add_q_proj", h, h),
            ("attn.add_k_proj", h, h),
            ("attn.add_v_proj", h, h),
            ("attn.to_out.0", h, h),
            ("attn.to_add_out", h, h),
            ("ff.net.0.proj", MLP, h),
            ("ff.net.2", h, MLP),
            ("ff_context.net.0.proj", MLP, h),
            ("ff_context.net.2", h, MLP),
            ("norm1.linear", 6 * h, h),
            ("norm1_context.linear", 6 * h, h),
        ] {
            v.push((format!("{b}.{m}"), o, i));
        }
    }
    for n in 0..SINGLE {
        let b = format!("single_transformer_blocks.{n}");
        for (m, o, i) in [
            ("attn.to_q", h, h),
            ("attn.to_k", h, h),
            ("attn.to_v", h, h),
            ("proj_mlp", MLP, h),
            ("proj_out", h, h + MLP),
            ("norm.linear", 3 * h, h),
        ] {
            v.push((format!("{b}.{m}"), o, i));
        }
    }
    v
}

/// A safetensors file declaring `shapes` in bf16 whose data is a hole (a sparse file): a lazy
/// model reads its header only.
fn sparse_checkpoint(path: &std::path::Path, shapes: &[(String, Vec<usize>)]) -> u64 {
    let mut header = String::from("{");
    let mut offset = 0u64;
    for (i, (key, shape)) in shapes.iter().enumerate() {
        let bytes = shape.iter().product::<usize>() as u64 * 2;
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        if i > 0 {
            header.push(',');
        }
        header.push_str(&format!(
            "\"{key}\":{{\"dtype\":\"BF16\",\"shape\":[{}],\"data_offsets\":[{offset},{}]}}",
            dims.join(","),
            offset + bytes
        ));
        offset += bytes;
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut f = std::fs::File::create(path).expect("checkpoint");
    f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
    f.write_all(header.as_bytes()).unwrap();
    f.set_len(8 + header.len() as u64 + offset).unwrap();
    offset
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn bench(_: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let shapes = flux_shapes();
    let ckpt = dir.path().join("flux-dev.safetensors");
    let model_bytes = sparse_checkpoint(&ckpt, &shapes);
    let tier = HostTier::new(None);
    let model = Model::from_safetensors_lazy("flux-dev", &[&ckpt], &tier).expect("lazy model");
    let base = ModelPatcher::on_device(Arc::new(model), DeviceId::Cpu);

    let modules = lora_modules();
    let mut tensors = Vec::new();
    for (i, (m, o, inn)) in modules.iter().enumerate() {
        let up = Tensor::randn(0f32, 0.01, (*o, RANK), &Device::Cpu).unwrap();
        let down = Tensor::randn(0f32, 0.01, (RANK, *inn), &Device::Cpu).unwrap();
        let bf = |t: Tensor| {
            residency::float::from_f32(&t, Dtype::BF16, residency::Rounding::Nearest).unwrap()
        };
        tensors.push((
            format!("transformer.{m}.lora_B.weight"),
            bf(up),
            Dtype::BF16,
        ));
        tensors.push((
            format!("transformer.{m}.lora_A.weight"),
            bf(down),
            Dtype::BF16,
        ));
        let _ = i;
    }
    let lora_path = dir.path().join("flux-lora.safetensors");
    save_safetensors(&lora_path, &tensors, &SafetensorsOptions::default()).expect("lora file");
    let lora_bytes = std::fs::metadata(&lora_path).map(|m| m.len()).unwrap_or(0);
    drop(tensors);

    let mut read = Vec::new();
    let mut scan = Vec::new();
    let mut map = Vec::new();
    let mut register = Vec::new();
    let mut patches_n = 0;
    let mut unmatched = 0;
    for _ in 0..ROUNDS {
        // The limit: the file's tensors read (candle's own reader, mmap + copy out).
        let t0 = Instant::now();
        let raw: HashMap<String, Tensor> =
            candle_core::safetensors::load(&lora_path, &Device::Cpu).expect("read");
        read.push(t0.elapsed());
        // One pass over every value.
        let t0 = Instant::now();
        let mut finite = true;
        for t in raw.values() {
            let v = t
                .to_dtype(candle_core::DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap();
            finite &= v.to_vec1::<f32>().unwrap().iter().all(|x| x.is_finite());
        }
        scan.push(t0.elapsed());
        assert!(finite);
        drop(raw);
        // Ours: read + group + map (`load_for`), then register on a clone (`add_patches`).
        let t0 = Instant::now();
        let lora = lora_file::load_for(&lora_path, base.model()).expect("load_for");
        map.push(t0.elapsed());
        patches_n = lora.patches.len();
        unmatched = lora.unmatched_lora_keys.len();
        let t0 = Instant::now();
        let mut styled = base.clone();
        styled
            .add_patches(lora.patches, 1.0, 1.0)
            .expect("add_patches");
        register.push(t0.elapsed());
        std::hint::black_box(&styled);
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let (read, scan, map, register) = (
        median(&mut read),
        median(&mut scan),
        median(&mut map),
        median(&mut register),
    );
    println!();
    println!(
        "lora_load: Flux-dev key set ({} weights, {:.1} GB bf16, sparse, read lazily), a rank-{RANK} LoRA \
         on every linear ({} modules, {:.0} MiB bf16, PEFT names), median of {ROUNDS}:",
        shapes.len(),
        model_bytes as f64 / 1e9,
        modules.len(),
        lora_bytes as f64 / (1u64 << 20) as f64
    );
    println!(
        "  load_for (read, group, map)      {:>8.1} ms   {patches_n} patches, {unmatched} LoRA tensors unmatched",
        ms(map)
    );
    println!(
        "  add_patches on a clone           {:>8.1} ms   (shapes and values checked)",
        ms(register)
    );
    println!(
        "  total                            {:>8.1} ms   limits: reading the file {:.1} ms, one pass over its values {:.1} ms",
        ms(map + register),
        ms(read),
        ms(scan)
    );
}

criterion_group!(benches, bench);
/// `criterion_main!(benches)`, with candle's thread count cached first
/// ([`residency::tools::cache_candle_thread_count`]).
fn main() {
    residency::tools::cache_candle_thread_count();
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
