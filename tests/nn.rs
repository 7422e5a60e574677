//! `residency::nn` as a drop-in for candle-nn: one model's source, written once in a
//! `macro_rules!` body, compiled against `candle_nn` and against `residency::nn`. The two agree,
//! and the residency one gives the same bits fully loaded, a quarter resident and under
//! `--novram`, with a LoRA on it too, and prefetches its second forward without being told where
//! the first one ended.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::{manager, rand_tensor};
use residency::float::Dtype;
use residency::loader::{LoadOptions, MemoryManager};
use residency::ops::OpsMode;
use residency::patcher::{Lora, ModelPatcher, Patch};
use residency::vram::{Config, DeviceId, Hardware};
use residency::weights::{save_safetensors, Model, SafetensorsOptions};
use residency::ByteSize;

const VOCAB: usize = 32;
const HIDDEN: usize = 16;
const FF: usize = 48;
const LAYERS: usize = 3;
const SEQ: usize = 6;

/// The model, as candle-nn code: every layer kind, `vb.get`, candle-nn's ops and activations,
/// `?` on candle's `Result`. Written once; `nn` is whichever crate the instantiation imports.
macro_rules! tiny_model {
    () => {
        use candle_core::{Module, Result, Tensor, D};
        use nn::VarBuilder;

        pub struct Block {
            norm: nn::LayerNorm,
            qkv: nn::Linear,
            out: nn::Linear,
            mlp_norm: nn::RmsNorm,
            up: nn::Linear,
            down: nn::Linear,
            act: nn::Activation,
        }

        impl Block {
            fn new(vb: VarBuilder<'_>) -> Result<Self> {
                Ok(Block {
                    norm: nn::layer_norm(super::HIDDEN, 1e-5, vb.pp("norm"))?,
                    qkv: nn::linear(super::HIDDEN, 3 * super::HIDDEN, vb.pp("attn").pp("qkv"))?,
                    out: nn::linear_no_bias(super::HIDDEN, super::HIDDEN, vb.pp("attn.out"))?,
                    mlp_norm: nn::rms_norm(super::HIDDEN, 1e-6, vb.pp("mlp_norm"))?,
                    up: nn::linear_b(super::HIDDEN, super::FF, true, vb.pp("mlp").pp("up"))?,
                    down: nn::linear(super::FF, super::HIDDEN, vb.pp("mlp").pp("down"))?,
                    act: nn::Activation::Gelu,
                })
            }

            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                let h = self.norm.forward(x)?;
                let qkv = self.qkv.forward(&h)?;
                let q = qkv.narrow(D::Minus1, 0, super::HIDDEN)?;
                let k = qkv.narrow(D::Minus1, super::HIDDEN, super::HIDDEN)?;
                let v = qkv.narrow(D::Minus1, 2 * super::HIDDEN, super::HIDDEN)?;
                let scores = (q.matmul(&k.t()?)? / (super::HIDDEN as f64).sqrt())?;
                let attn = nn::ops::softmax_last_dim(&scores)?.matmul(&v)?;
                let x = (x + self.out.forward(&attn)?)?;
                let h = self.mlp_norm.forward(&x)?;
                let h = self
                    .down
                    .forward(&self.act.forward(&self.up.forward(&h)?)?)?;
                x + h
            }
        }

        pub struct TinyNet {
            embed: nn::Embedding,
            pos: Tensor,
            conv: nn::Conv1d,
            group_norm: nn::GroupNorm,
            blocks: Vec<Block>,
            final_norm: nn::LayerNorm,
            up_conv: nn::ConvTranspose1d,
            image_conv: nn::Conv2d,
            image_up: nn::ConvTranspose2d,
            head: nn::Linear,
        }

        impl TinyNet {
            pub fn new(vb: VarBuilder<'_>) -> Result<Self> {
                let conv_cfg = nn::Conv1dConfig {
                    padding: 1,
                    groups: 2,
                    ..Default::default()
                };
                let up_cfg = nn::ConvTranspose1dConfig {
                    stride: 2,
                    ..Default::default()
                };
                let image_cfg = nn::Conv2dConfig {
                    padding: 1,
                    ..Default::default()
                };
                let image_up_cfg = nn::ConvTranspose2dConfig {
                    stride: 2,
                    ..Default::default()
                };
                let blocks = (0..super::LAYERS)
                    .map(|i| Block::new(vb.pp("blocks").pp(i)))
                    .collect::<Result<Vec<_>>>()?;
                Ok(TinyNet {
                    embed: nn::embedding(super::VOCAB, super::HIDDEN, vb.pp("embed"))?,
                    pos: vb.get((super::SEQ, super::HIDDEN), "pos")?,
                    conv: nn::conv1d(super::HIDDEN, super::HIDDEN, 3, conv_cfg, vb.pp("conv"))?,
                    group_norm: nn::group_norm(4, super::HIDDEN, 1e-5, vb.pp("gn"))?,
                    blocks,
                    final_norm: nn::layer_norm(
                        super::HIDDEN,
                        nn::LayerNormConfig {
                            eps: 1e-5,
                            remove_mean: false,
                            affine: true,
                        },
                        vb.pp("final_norm"),
                    )?,
                    up_conv: nn::conv_transpose1d_no_bias(
                        super::HIDDEN,
                        4,
                        2,
                        up_cfg,
                        vb.pp("up_conv"),
                    )?,
                    image_conv: nn::conv2d(1, 2, 3, image_cfg, vb.pp("image_conv"))?,
                    image_up: nn::conv_transpose2d(2, 1, 2, image_up_cfg, vb.pp("image_up"))?,
                    head: nn::linear(super::HIDDEN, super::VOCAB, vb.pp("head"))?,
                })
            }

            /// `ids` `[B, SEQ]` → (logits `[B, SEQ, VOCAB]`, an image `[B, 1, 4·2, 2·SEQ·2]`).
            pub fn forward(&self, ids: &Tensor) -> Result<(Tensor, Tensor)> {
                let x = self.embed.forward(ids)?.broadcast_add(&self.pos)?;
                // Channels first for the convolutions over the sequence.
                let c = self.conv.forward(&x.transpose(1, 2)?.contiguous()?)?;
                let c = self.group_norm.forward(&c)?;
                let mut x = (x + c.transpose(1, 2)?)?;
                for block in &self.blocks {
                    x = block.forward(&x)?;
                }
                let x = self.final_norm.forward(&x)?;
                let logits = self.head.forward(&x)?;
                let up = self.up_conv.forward(&x.transpose(1, 2)?.contiguous()?)?;
                let image = self
                    .image_up
                    .forward(&self.image_conv.forward(&up.unsqueeze(1)?)?)?;
                Ok((logits, image))
            }
        }
    };
}

mod with_candle_nn {
    use candle_nn as nn;
    tiny_model!();
}

mod with_residency {
    use residency::nn;
    tiny_model!();
}

fn weight_shapes() -> Vec<(String, Vec<usize>)> {
    let mut w: Vec<(String, Vec<usize>)> = vec![
        ("embed.weight".into(), vec![VOCAB, HIDDEN]),
        ("pos".into(), vec![SEQ, HIDDEN]),
        ("conv.weight".into(), vec![HIDDEN, HIDDEN / 2, 3]),
        ("conv.bias".into(), vec![HIDDEN]),
        ("gn.weight".into(), vec![HIDDEN]),
        ("gn.bias".into(), vec![HIDDEN]),
        ("final_norm.weight".into(), vec![HIDDEN]),
        ("final_norm.bias".into(), vec![HIDDEN]),
        ("up_conv.weight".into(), vec![HIDDEN, 4, 2]),
        ("image_conv.weight".into(), vec![2, 1, 3, 3]),
        ("image_conv.bias".into(), vec![2]),
        ("image_up.weight".into(), vec![2, 1, 2, 2]),
        ("image_up.bias".into(), vec![1]),
        ("head.weight".into(), vec![VOCAB, HIDDEN]),
        ("head.bias".into(), vec![VOCAB]),
    ];
    for l in 0..LAYERS {
        let b = |s: &str| format!("blocks.{l}.{s}");
        w.extend([
            (b("norm.weight"), vec![HIDDEN]),
            (b("norm.bias"), vec![HIDDEN]),
            (b("attn.qkv.weight"), vec![3 * HIDDEN, HIDDEN]),
            (b("attn.qkv.bias"), vec![3 * HIDDEN]),
            (b("attn.out.weight"), vec![HIDDEN, HIDDEN]),
            (b("mlp_norm.weight"), vec![HIDDEN]),
            (b("mlp.up.weight"), vec![FF, HIDDEN]),
            (b("mlp.up.bias"), vec![FF]),
            (b("mlp.down.weight"), vec![HIDDEN, FF]),
            (b("mlp.down.bias"), vec![HIDDEN]),
        ]);
    }
    w
}

/// Writes the checkpoint in `storage` and returns its path.
fn checkpoint(dir: &Path, storage: Dtype) -> PathBuf {
    let path = dir.join(format!("tiny-{storage}.safetensors"));
    let tensors: Vec<(String, Tensor, Dtype)> = weight_shapes()
        .into_iter()
        .enumerate()
        .map(|(i, (key, shape))| {
            let t = (rand_tensor(&shape, 1000 + i as u64) * 0.5).unwrap();
            let t = residency::float::from_f32(&t, storage, residency::Rounding::Nearest).unwrap();
            (key, t, storage)
        })
        .collect();
    save_safetensors(&path, &tensors, &SafetensorsOptions::default()).unwrap();
    path
}

fn ids() -> Tensor {
    Tensor::new(
        &[[1u32, 5, 9, 31, 0, 7], [2, 2, 17, 30, 11, 4]],
        &Device::Cpu,
    )
    .unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    common::f32s(t)
}

fn bits(t: &(Tensor, Tensor)) -> Vec<u32> {
    f32s(&t.0)
        .into_iter()
        .chain(f32s(&t.1))
        .map(f32::to_bits)
        .collect()
}

/// The candle-nn model on `tensors` (read in f32, as candle-nn reads a checkpoint).
fn candle_nn_model(tensors: std::collections::HashMap<String, Tensor>) -> with_candle_nn::TinyNet {
    let vb = candle_nn::VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    with_candle_nn::TinyNet::new(vb).unwrap()
}

fn residency_model(p: &ModelPatcher) -> with_residency::TinyNet {
    let mode = OpsMode::ManualCast {
        compute: Dtype::F32,
    };
    let vb = residency::nn::VarBuilder::from_patcher(p, mode).unwrap();
    with_residency::TinyNet::new(vb).unwrap()
}

fn patcher(path: &Path) -> ModelPatcher {
    let model = Model::from_safetensors("tiny", &[path]).unwrap();
    ModelPatcher::new(Arc::new(model), DeviceId::Cpu, DeviceId::Cpu)
        .with_compute_dtype(Some(Dtype::F32))
}

/// Loads `p` on `mm`, runs the residency model twice (the second forward is the one compared;
/// its weights may come from prefetch), returns the bits and the resident share.
fn run(p: &ModelPatcher, mm: &MemoryManager) -> (Vec<u32>, f64) {
    let report = mm
        .load_models_gpu(std::slice::from_ref(p), LoadOptions::default())
        .unwrap();
    let resident = report.models[0].resident.as_f64() / p.resident_model_size().as_f64();
    let net = residency_model(p);
    let first = bits(&net.forward(&ids()).unwrap());
    let second = bits(&net.forward(&ids()).unwrap());
    assert_eq!(first, second, "two forwards of one load differ");
    p.detach();
    (second, resident)
}

fn with_lora(base: &ModelPatcher) -> ModelPatcher {
    let mut p = base.clone();
    let mut patches = Vec::new();
    for (i, key) in [
        "blocks.0.attn.qkv.weight",
        "blocks.2.mlp.down.weight",
        "head.weight",
    ]
    .into_iter()
    .enumerate()
    {
        let shape = p.model().slot(key).unwrap().shape().to_vec();
        let lora = Lora::new(
            rand_tensor(&[shape[0], 4], 50 + i as u64),
            rand_tensor(&[4, shape[1]], 60 + i as u64),
        );
        patches.push((key, Patch::Lora(lora)));
    }
    assert_eq!(p.add_patches(patches, 0.5, 1.0).unwrap().len(), 3);
    p
}

/// The done-when check: candle-nn and residency::nn agree; residency's bits are the same fully
/// loaded, a quarter resident and under `--novram`.
fn check(storage: Dtype) {
    let dir = tempfile::tempdir().unwrap();
    let path = checkpoint(dir.path(), storage);
    let base = patcher(&path);

    let theirs = candle_nn_model(candle_core::safetensors::load(&path, &Device::Cpu).unwrap());
    let want = theirs.forward(&ids()).unwrap();
    assert_eq!(want.0.dims(), &[2, SEQ, VOCAB]);
    assert_eq!(want.1.dims(), &[2, 1, 8, 4 * SEQ]);

    let rz = ["--reserve-vram", "0"];
    let size = base.resident_model_size();
    for p in [base.clone(), with_lora(&base)] {
        let lora = !p.patches().is_empty();
        let (full, r_full) = run(&p, &manager(ByteSize::gib(1), &rz));
        let (quarter, r_quarter) = run(&p, &manager(ByteSize(size.bytes() / 4), &rz));
        let novram = ["--novram", "--reserve-vram", "0"];
        let (none, r_none) = run(&p, &manager(ByteSize::gib(1), &novram));
        assert!(r_full > 0.999, "{storage} lora={lora}: full load {r_full}");
        assert!(
            r_quarter > 0.05 && r_quarter <= 0.25,
            "{storage} lora={lora}: quarter load {r_quarter}"
        );
        assert_eq!(r_none, 0.0, "{storage} lora={lora}: novram");
        assert_eq!(
            full, quarter,
            "{storage} lora={lora}: quarter differs from full"
        );
        assert_eq!(
            full, none,
            "{storage} lora={lora}: novram differs from full"
        );

        // candle-nn on the same weights (patched ones for the LoRA clone) agrees.
        let reference = if lora {
            let merged = p
                .patched_state_dict()
                .unwrap()
                .into_iter()
                .map(|(k, t, _)| (k, t.to_dtype(DType::F32).unwrap()))
                .collect();
            candle_nn_model(merged).forward(&ids()).unwrap()
        } else {
            theirs.forward(&ids()).unwrap()
        };
        let reference = bits(&reference);
        let max_diff = full
            .iter()
            .zip(&reference)
            .map(|(a, b)| (f32::from_bits(*a) - f32::from_bits(*b)).abs())
            .fold(0f32, f32::max);
        assert!(
            max_diff <= 1e-5,
            "{storage} lora={lora}: max diff {max_diff}"
        );
        if !lora {
            assert_eq!(full, bits(&want), "{storage}: not candle-nn's bits");
        }
    }
}

#[test]
fn candle_nn_model_source_ported_by_one_use_line_agrees_and_is_bit_identical_across_budgets() {
    check(Dtype::F32);
}

#[test]
fn half_storage_ported_model_agrees_with_candle_nn_reading_the_same_checkpoint() {
    check(Dtype::BF16);
}

#[test]
fn second_forward_is_prefetched_without_finish_forward() {
    let dir = tempfile::tempdir().unwrap();
    let p = patcher(&checkpoint(dir.path(), Dtype::BF16));
    let config = Config::from_args(["--novram", "--vram-budget", "1GiB", "--reserve-vram", "0"])
        .unwrap()
        .with_transfer_lanes(2)
        .with_prefetch_depth(2);
    let mm = MemoryManager::new(config, Hardware::cpu_only(ByteSize::gib(64))).unwrap();
    mm.load_models_gpu(std::slice::from_ref(&p), LoadOptions::default())
        .unwrap();
    let net = residency_model(&p);
    let first = bits(&net.forward(&ids()).unwrap());
    let (order, complete) = p.model().forward_order();
    assert!(!complete, "nothing has said the first forward ended yet");
    // Every weight but `pos` (read once while building) is fetched by the forward.
    assert_eq!(order.len(), weight_shapes().len() - 1);
    assert!(!p.model().forward_order_keys().contains(&"pos".to_string()));
    let before = mm.transfer_stats();
    let second = bits(&net.forward(&ids()).unwrap());
    assert_eq!(first, second);
    assert!(
        p.model().forward_order().1,
        "the second forward completed the order"
    );
    let after = mm.transfer_stats();
    let hits = after.prefetch_hits - before.prefetch_hits;
    // The second forward's first weight is fetched before anyone knows the order; each later one
    // was requested by the fetch before it.
    assert!(
        hits as usize >= order.len() - 2,
        "{hits} hits of {}",
        order.len()
    );
}
