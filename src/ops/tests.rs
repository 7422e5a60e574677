//! Each layer against the plain candle computation of the same op, in every mode.

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor, D};

use super::*;
use crate::float::Rounding;
use crate::patcher::{Lora, Patch};
use crate::weights::Model;

fn rand(shape: &[usize], seed: u64) -> Tensor {
    crate::float::uniform_tensor(shape, seed).unwrap()
}

/// The layers' weights in f32, and a model holding them in `storage`.
fn weights() -> Vec<(&'static str, Tensor)> {
    vec![
        ("lin.weight", rand(&[6, 5], 1)),
        ("lin.bias", rand(&[6], 2)),
        ("c1.weight", rand(&[4, 3, 3], 3)),
        ("c1.bias", rand(&[4], 4)),
        ("c2.weight", rand(&[4, 1, 3, 3], 5)),
        ("c2.bias", rand(&[4], 6)),
        ("ct.weight", rand(&[4, 2, 2, 2], 7)),
        ("ct.bias", rand(&[2], 8)),
        ("gn.weight", rand(&[4], 9)),
        ("gn.bias", rand(&[4], 10)),
        ("ln.weight", rand(&[5], 11)),
        ("ln.bias", rand(&[5], 12)),
        ("rms.weight", rand(&[5], 13)),
        ("emb.weight", rand(&[7, 5], 14)),
    ]
}

fn model(storage: Dtype) -> Model {
    let t = weights().into_iter().map(|(k, t)| {
        (
            k,
            float::from_f32(&t, storage, Rounding::Nearest).unwrap(),
            storage,
        )
    });
    Model::from_typed_tensors("ops-test", t).unwrap()
}

fn patcher(storage: Dtype) -> ModelPatcher {
    ModelPatcher::new(Arc::new(model(storage)), DeviceId::Cpu, DeviceId::Cpu)
}

/// The weight `key` as the layers should see it: storage-rounded, then f32.
fn plain(key: &str, storage: Dtype) -> Tensor {
    let t = weights().into_iter().find(|(k, _)| *k == key).unwrap().1;
    float::to_f32(
        &float::from_f32(&t, storage, Rounding::Nearest).unwrap(),
        storage,
    )
    .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn ln_plain(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64) -> Tensor {
    let mean = x.mean_keepdim(D::Minus1).unwrap();
    let xc = x.broadcast_sub(&mean).unwrap();
    let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let y = xc
        .broadcast_div(&(var + eps).unwrap().sqrt().unwrap())
        .unwrap()
        .broadcast_mul(w)
        .unwrap();
    match b {
        Some(b) => y.broadcast_add(b).unwrap(),
        None => y,
    }
}

/// Every layer equals the plain candle op on the same (storage-rounded) weights.
fn check_all_layers(storage: Dtype, mode: OpsMode) {
    let p = patcher(storage);
    let ops = OpsBuilder::new(&p, mode);
    let w = |k: &str| plain(k, storage);
    let tol = 1e-6;

    let x = rand(&[2, 3, 5], 20);
    let lin = ops.linear("lin", true).unwrap();
    let want = x
        .reshape((6, 5))
        .unwrap()
        .matmul(&w("lin.weight").t().unwrap())
        .unwrap()
        .broadcast_add(&w("lin.bias"))
        .unwrap()
        .reshape((2, 3, 6))
        .unwrap();
    assert!(
        max_diff(&lin.forward(&x).unwrap(), &want) <= tol,
        "linear {mode:?}"
    );

    let x = rand(&[2, 3, 9], 21);
    let c1 = ops
        .conv1d(
            "c1",
            ConvConfig {
                padding: 1,
                stride: 2,
                ..Default::default()
            },
            true,
        )
        .unwrap();
    let want = x
        .conv1d(&w("c1.weight"), 1, 2, 1, 1)
        .unwrap()
        .broadcast_add(&w("c1.bias").reshape((1, 4, 1)).unwrap())
        .unwrap();
    assert!(
        max_diff(&c1.forward(&x).unwrap(), &want) <= tol,
        "conv1d {mode:?}"
    );

    let x = rand(&[1, 4, 6, 6], 22);
    let c2 = ops
        .conv2d(
            "c2",
            ConvConfig {
                padding: 1,
                groups: 4,
                ..Default::default()
            },
            true,
        )
        .unwrap();
    let want = x
        .conv2d(&w("c2.weight"), 1, 1, 1, 4)
        .unwrap()
        .broadcast_add(&w("c2.bias").reshape((1, 4, 1, 1)).unwrap())
        .unwrap();
    assert!(
        max_diff(&c2.forward(&x).unwrap(), &want) <= tol,
        "conv2d {mode:?}"
    );

    let ct = ops
        .conv_transpose2d(
            "ct",
            ConvTransposeConfig {
                stride: 2,
                ..Default::default()
            },
            true,
        )
        .unwrap();
    let want = x
        .conv_transpose2d(&w("ct.weight"), 0, 0, 2, 1)
        .unwrap()
        .broadcast_add(&w("ct.bias").reshape((1, 2, 1, 1)).unwrap())
        .unwrap();
    assert!(
        max_diff(&ct.forward(&x).unwrap(), &want) <= tol,
        "convT {mode:?}"
    );

    let gn = ops.group_norm("gn", 2, 1e-5).unwrap();
    let g = x.reshape((1, 2, 72)).unwrap();
    let mean = g.mean_keepdim(2).unwrap();
    let gc = g.broadcast_sub(&mean).unwrap();
    let var = gc.sqr().unwrap().mean_keepdim(2).unwrap();
    let want = gc
        .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
        .unwrap()
        .reshape((1, 4, 6, 6))
        .unwrap()
        .broadcast_mul(&w("gn.weight").reshape((1, 4, 1, 1)).unwrap())
        .unwrap()
        .broadcast_add(&w("gn.bias").reshape((1, 4, 1, 1)).unwrap())
        .unwrap();
    assert!(
        max_diff(&gn.forward(&x).unwrap(), &want) <= tol,
        "groupnorm {mode:?}"
    );

    let x = rand(&[2, 3, 5], 23);
    let ln = ops.layer_norm("ln", 1e-12, true).unwrap();
    let want = ln_plain(&x, &w("ln.weight"), Some(&w("ln.bias")), 1e-12);
    assert!(
        max_diff(&ln.forward(&x).unwrap(), &want) <= tol,
        "layernorm {mode:?}"
    );

    let rms = ops.rms_norm("rms", 1e-6).unwrap();
    let r = (x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + 1e-6)
        .unwrap()
        .sqrt()
        .unwrap();
    let want = x
        .broadcast_div(&r)
        .unwrap()
        .broadcast_mul(&w("rms.weight"))
        .unwrap();
    assert!(
        max_diff(&rms.forward(&x).unwrap(), &want) <= tol,
        "rmsnorm {mode:?}"
    );

    let ids = Tensor::new(&[[0u32, 6, 3], [2, 2, 1]], &Device::Cpu).unwrap();
    let emb = ops.embedding("emb").unwrap();
    let want = w("emb.weight")
        .index_select(&ids.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((2, 3, 5))
        .unwrap();
    assert!(
        max_diff(&emb.forward(&ids).unwrap(), &want) <= tol,
        "embedding {mode:?}"
    );
}

#[test]
fn every_layer_matches_plain_candle_in_every_mode_f32() {
    for mode in [
        OpsMode::DisableWeightInit,
        OpsMode::ManualCast {
            compute: Dtype::F32,
        },
        OpsMode::MixedPrecision {
            compute: Dtype::F32,
        },
    ] {
        check_all_layers(Dtype::F32, mode);
    }
}

#[test]
fn every_layer_matches_plain_candle_on_cast_weights_for_half_and_fp8_storage() {
    for storage in [Dtype::BF16, Dtype::F16, Dtype::F8E4M3FN, Dtype::F8E5M2] {
        for mode in [
            OpsMode::ManualCast {
                compute: Dtype::F32,
            },
            OpsMode::MixedPrecision {
                compute: Dtype::F32,
            },
        ] {
            check_all_layers(storage, mode);
        }
    }
}

#[test]
fn disable_weight_init_rejects_fp8_weights_and_mismatched_inputs() {
    let p = patcher(Dtype::F8E4M3FN);
    let lin = OpsBuilder::new(&p, OpsMode::DisableWeightInit)
        .linear("lin", true)
        .unwrap();
    let err = lin
        .try_forward(&rand(&[1, 5], 1).to_dtype(DType::F8E4M3).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("lin.weight"), "{err}");
    let p = patcher(Dtype::BF16);
    let lin = OpsBuilder::new(&p, OpsMode::DisableWeightInit)
        .linear("lin", true)
        .unwrap();
    let err = lin.try_forward(&rand(&[1, 5], 1)).unwrap_err();
    assert!(err.to_string().contains("DisableWeightInit"), "{err}");
    // Input in the weights' dtype works and computes in bf16.
    let y = lin
        .try_forward(&rand(&[1, 5], 1).to_dtype(DType::BF16).unwrap())
        .unwrap();
    assert_eq!(y.dtype(), DType::BF16);
}

#[test]
fn builder_walks_prefixes_and_names_missing_keys_and_bad_shapes() {
    let m = Model::from_tensors(
        "enc",
        [
            ("encoder.layer.0.query.weight", rand(&[4, 3], 1)),
            ("encoder.layer.0.query.bias", rand(&[4], 2)),
            ("encoder.layer.0.bad.weight", rand(&[4, 3], 3)),
            ("encoder.layer.0.bad.bias", rand(&[3], 4)),
        ],
    )
    .unwrap();
    let p = ModelPatcher::new(Arc::new(m), DeviceId::Cpu, DeviceId::Cpu);
    let b = OpsBuilder::new(&p, OpsMode::DisableWeightInit)
        .pp("encoder")
        .pp("layer")
        .pp(0);
    assert_eq!(b.key("query"), "encoder.layer.0.query");
    let q = b.linear("query", true).unwrap();
    assert_eq!(q.weights().weight_key(), "encoder.layer.0.query.weight");
    assert_eq!(q.weights().bias_key(), Some("encoder.layer.0.query.bias"));
    assert_eq!((q.in_dim(), q.out_dim()), (3, 4));
    let err = b.linear("key", true).unwrap_err();
    assert!(
        matches!(&err, Error::UnknownWeight { model, key } if model == "enc" && key == "encoder.layer.0.key.weight"),
        "{err}"
    );
    assert!(matches!(
        b.linear("bad", true).unwrap_err(),
        Error::ShapeMismatch { .. }
    ));
    assert!(matches!(
        b.linear_dims("query", 4, 4, true).unwrap_err(),
        Error::ShapeMismatch { .. }
    ));
    assert!(matches!(
        b.layer_norm("query", 1e-5, false).unwrap_err(),
        Error::ShapeMismatch { .. }
    ));
    let err = q.try_forward(&rand(&[2, 5], 1)).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
}

#[test]
fn pick_operations_follows_the_design_table() {
    use Dtype::*;
    let cpu = DeviceId::Cpu;
    let gpu = DeviceId::Cuda(0);
    assert_eq!(
        pick_operations(F16, None, gpu, false, false),
        OpsMode::DisableWeightInit
    );
    assert_eq!(
        pick_operations(F16, Some(F16), gpu, false, false),
        OpsMode::DisableWeightInit
    );
    assert_eq!(
        pick_operations(BF16, Some(F32), cpu, false, false),
        OpsMode::ManualCast { compute: F32 }
    );
    assert_eq!(
        pick_operations(F8E4M3FN, Some(BF16), gpu, false, false),
        OpsMode::ManualCast { compute: BF16 }
    );
    assert_eq!(
        pick_operations(F8E4M3FN, Some(BF16), gpu, false, true),
        OpsMode::MixedPrecision { compute: BF16 }
    );
    assert_eq!(
        pick_operations(F8E4M3FN, None, gpu, true, false),
        OpsMode::MixedPrecision { compute: BF16 }
    );
    assert_eq!(
        pick_operations(F8E5M2, None, cpu, false, true),
        OpsMode::MixedPrecision { compute: F32 }
    );
    // fp8 optimizations do nothing for non-fp8 weights.
    assert_eq!(
        pick_operations(F16, None, gpu, true, false),
        OpsMode::DisableWeightInit
    );
}

#[test]
fn mixed_precision_dequantizes_per_tensor_scaled_fp8() {
    let w = (rand(&[6, 5], 1) * 0.01).unwrap();
    for format in [Dtype::F8E4M3FN, Dtype::F8E5M2] {
        let (codes, scale) = quant::quantize_per_tensor(&w, format, "lin.weight").unwrap();
        let s = scale.to_vec1::<f32>().unwrap()[0];
        let m = Model::from_typed_tensors(
            "q",
            [
                ("lin.weight", codes.clone(), format),
                ("lin.weight_scale", scale, Dtype::F32),
            ],
        )
        .unwrap();
        let p = ModelPatcher::new(Arc::new(m), DeviceId::Cpu, DeviceId::Cpu);
        assert!(OpsBuilder::new(&p, OpsMode::DisableWeightInit)
            .linear("lin", false)
            .is_err());
        let lin = OpsBuilder::new(
            &p,
            OpsMode::MixedPrecision {
                compute: Dtype::F32,
            },
        )
        .linear("lin", false)
        .unwrap();
        assert_eq!(lin.weights().weight_scale(), Some(s));
        let x = rand(&[3, 5], 2);
        let deq = (float::to_f32(&codes, format).unwrap() * f64::from(s)).unwrap();
        let want = x.matmul(&deq.t().unwrap()).unwrap();
        assert_eq!(max_diff(&lin.forward(&x).unwrap(), &want), 0.0);
        // The dequantized weight is close to the original (scaling uses the fp8 range).
        let rel = max_diff(&deq, &w) / 0.005;
        assert!(rel < 0.15, "{format}: {rel}");
    }
}

#[test]
fn lora_on_a_scaled_weight_is_applied_in_dequantized_space() {
    let w = (rand(&[6, 5], 1) * 0.01).unwrap();
    let (codes, scale) = quant::quantize_per_tensor(&w, Dtype::F8E4M3FN, "lin.weight").unwrap();
    let m = Model::from_typed_tensors(
        "q",
        [
            ("lin.weight", codes, Dtype::F8E4M3FN),
            ("lin.weight_scale", scale, Dtype::F32),
        ],
    )
    .unwrap();
    let mut p = ModelPatcher::new(Arc::new(m), DeviceId::Cpu, DeviceId::Cpu);
    let base = OpsBuilder::new(
        &p,
        OpsMode::MixedPrecision {
            compute: Dtype::F32,
        },
    )
    .linear("lin", false)
    .unwrap();
    let up = (rand(&[6, 2], 3) * 0.05).unwrap();
    let down = (rand(&[2, 5], 4) * 0.05).unwrap();
    let lora = Lora {
        up: up.clone(),
        down: down.clone(),
        alpha: None,
        mid: None,
        dora_scale: None,
    };
    p.add_patches([("lin.weight", Patch::Lora(lora))], 1.0, 1.0)
        .unwrap();
    let patched = OpsBuilder::new(
        &p,
        OpsMode::MixedPrecision {
            compute: Dtype::F32,
        },
    )
    .linear("lin", false)
    .unwrap();
    let x = rand(&[3, 5], 2);
    let delta = (patched.forward(&x).unwrap() - base.forward(&x).unwrap()).unwrap();
    let want = x.matmul(&up.matmul(&down).unwrap().t().unwrap()).unwrap();
    // Within fp8 requantization error of the (small) weights, far from delta × scale.
    assert!(
        max_diff(&delta, &want) < 2e-3,
        "{}",
        max_diff(&delta, &want)
    );
}

#[test]
fn weight_wrappers_run_after_the_cast_on_every_use() {
    let mut p = patcher(Dtype::BF16);
    p.add_weight_wrapper("lin.weight", |t: Tensor| {
        assert_eq!(t.dtype(), DType::F32);
        (t * 2.0).map_err(Error::from)
    });
    let lin = OpsBuilder::new(
        &p,
        OpsMode::ManualCast {
            compute: Dtype::F32,
        },
    )
    .linear("lin", false)
    .unwrap();
    let x = rand(&[1, 5], 1);
    let want = (x
        .matmul(&plain("lin.weight", Dtype::BF16).t().unwrap())
        .unwrap()
        * 2.0)
        .unwrap();
    assert_eq!(max_diff(&lin.forward(&x).unwrap(), &want), 0.0);
    // Clones share wrappers; the original patcher without them is unchanged.
    assert_eq!(p.clone().weight_wrappers("lin.weight").len(), 1);
    assert!(patcher(Dtype::BF16)
        .weight_wrappers("lin.weight")
        .is_empty());
}

#[test]
fn first_forward_records_fetch_order_and_finish_completes_it() {
    let p = patcher(Dtype::F32);
    let ops = OpsBuilder::new(&p, OpsMode::DisableWeightInit);
    let ln = ops.layer_norm("ln", 1e-5, true).unwrap();
    let lin = ops.linear("lin", true).unwrap();
    let x = rand(&[1, 5], 1);
    let y = lin.forward(&ln.forward(&x).unwrap()).unwrap();
    assert_eq!(y.dims(), &[1, 6]);
    let model = Arc::clone(p.model());
    assert_eq!(
        model.forward_order_keys(),
        ["ln.weight", "ln.bias", "lin.weight", "lin.bias"]
    );
    assert!(!model.forward_order().1);
    ops.source().finish_forward();
    assert!(model.forward_order().1);
    // A second forward in another order does not change the recording.
    lin.forward(
        &x.broadcast_as((1, 5))
            .unwrap()
            .matmul(&Tensor::eye(5, DType::F32, &Device::Cpu).unwrap())
            .unwrap(),
    )
    .unwrap();
    assert_eq!(model.forward_order_keys()[0], "ln.weight");
}

#[test]
fn set_patcher_switches_layers_and_rejects_other_models() {
    let p = patcher(Dtype::F32);
    let ops = OpsBuilder::new(&p, OpsMode::DisableWeightInit);
    let lin = ops.linear("lin", false).unwrap();
    let x = rand(&[1, 5], 1);
    let base = lin.forward(&x).unwrap();
    let mut q = p.clone();
    q.add_patches(
        [(
            "lin.weight",
            Patch::Set(Tensor::zeros((6, 5), DType::F32, &Device::Cpu).unwrap()),
        )],
        1.0,
        1.0,
    )
    .unwrap();
    ops.source().set_patcher(&q).unwrap();
    assert_eq!(
        max_diff(&lin.forward(&x).unwrap(), &(&base * 0.0).unwrap()),
        0.0
    );
    ops.source().set_patcher(&p).unwrap();
    assert_eq!(max_diff(&lin.forward(&x).unwrap(), &base), 0.0);
    assert!(ops.source().set_patcher(&patcher(Dtype::F32)).is_err());
}

#[test]
fn fused_norm_kernels_and_ours_agree_on_contiguous_and_strided_inputs() {
    let p = patcher(Dtype::F32);
    let ops = OpsBuilder::new(&p, OpsMode::DisableWeightInit);
    let ln = ops.layer_norm("ln", 1e-5, true).unwrap();
    let ln_nb = ops.layer_norm("ln", 1e-5, false).unwrap();
    let rms = ops.rms_norm("rms", 1e-6).unwrap();
    // The same values, contiguous (fused kernels) and strided (ours).
    let strided = rand(&[5, 3, 2], 70).transpose(0, 2).unwrap();
    assert!(!strided.is_contiguous());
    let contiguous = strided.contiguous().unwrap();
    for (name, layer) in [
        ("layer norm", &ln as &dyn Module),
        ("layer norm without bias", &ln_nb),
        ("rms norm", &rms),
    ] {
        let fused = layer.forward(&contiguous).unwrap();
        let ours = layer.forward(&strided).unwrap();
        assert_eq!(fused.dims(), &[2, 3, 5]);
        let d = max_diff(&fused, &ours);
        assert!(d <= 1e-5 && d.is_finite(), "{name}: {d}");
    }
}

#[test]
fn resident_copies_wider_than_the_layers_compute_warn_once_narrower_ones_do_not() {
    use crate::trace::Trace;
    use tracing_subscriber::layer::SubscriberExt;

    // What warns, counted by the events naming the patcher's setter; every model's layers are
    // built by several builders (here two).
    let warned = |resident: Option<Dtype>, mode: OpsMode| {
        let trace = Trace::new();
        let subscriber = tracing_subscriber::registry().with(trace.layer());
        let p = patcher(Dtype::BF16).with_compute_dtype(resident);
        tracing::subscriber::with_default(subscriber, || {
            let b = OpsBuilder::new(&p, mode);
            let _ = OpsBuilder::from_source(b.source(), mode);
        });
        trace
            .records()
            .iter()
            .filter(|r| r.name.contains("ModelPatcher::with_compute_dtype"))
            .map(|r| r.name.to_string())
            .collect::<Vec<_>>()
    };
    let bf16 = OpsMode::ManualCast {
        compute: Dtype::BF16,
    };
    let f32 = OpsMode::ManualCast {
        compute: Dtype::F32,
    };
    let wide = warned(Some(Dtype::F32), bf16);
    assert_eq!(wide.len(), 1, "{wide:?}");
    assert!(
        wide[0].contains("2× the memory") && wide[0].contains("BF16"),
        "{wide:?}"
    );
    // The same dtype, narrower resident copies (fp16 storage, an f32 cast), none given, or the
    // weights used as stored: nothing to say.
    assert!(warned(Some(Dtype::F32), f32).is_empty());
    assert!(warned(Some(Dtype::F16), f32).is_empty());
    assert!(warned(None, bf16).is_empty());
    assert!(warned(Some(Dtype::F32), OpsMode::DisableWeightInit).is_empty());
}
