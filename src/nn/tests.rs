//! Unit tests of `nn`: each constructor accepts and refuses what candle-nn 0.11 does, and what it
//! accepts computes candle-nn's bits.

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Tensor};

use super::*;
use crate::float::{uniform_tensor, Dtype};
use crate::ops::{OpsMode, OpsSource};
use crate::patcher::{Patch, PatchEntry};
use crate::weights::Model;
use crate::{DeviceId, ModelPatcher};

fn weights() -> Vec<(&'static str, Vec<usize>)> {
    vec![
        ("lin.weight", vec![3, 4]),
        ("lin.bias", vec![3]),
        ("lin_nb.weight", vec![3, 4]),
        ("emb.weight", vec![10, 4]),
        ("ln.weight", vec![4]),
        ("ln.bias", vec![4]),
        ("lng.gamma", vec![4]),
        ("lng.beta", vec![4]),
        ("rms.weight", vec![4]),
        ("gn.weight", vec![4]),
        ("gn.bias", vec![4]),
        ("c1.weight", vec![6, 2, 3]),
        ("c1.bias", vec![6]),
        ("c2.weight", vec![6, 4, 3, 3]),
        ("c2.bias", vec![6]),
        ("ct1.weight", vec![4, 3, 3]),
        ("ct1.bias", vec![6]),
        ("ct2.weight", vec![4, 6, 3, 3]),
        ("ct2.bias", vec![6]),
        ("pos", vec![2, 4]),
    ]
}

fn tensors() -> Vec<(String, Tensor)> {
    weights()
        .into_iter()
        .enumerate()
        .map(|(i, (k, s))| (k.to_string(), uniform_tensor(&s, 40 + i as u64).unwrap()))
        .collect()
}

fn patcher() -> ModelPatcher {
    let model = Model::from_tensors("parity", tensors()).unwrap();
    ModelPatcher::new(model, DeviceId::Cpu, DeviceId::Cpu)
}

fn builders() -> (VarBuilder<'static>, candle_nn::VarBuilder<'static>) {
    let ours = VarBuilder::from_patcher(&patcher(), OpsMode::DisableWeightInit).unwrap();
    let map: HashMap<String, Tensor> = tensors().into_iter().collect();
    let theirs = candle_nn::VarBuilder::from_tensors(map, DType::F32, &Device::Cpu);
    (ours, theirs)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Both constructors succeed and their layers give the same bits on `x` (or both forwards fail),
/// or both constructors fail. Returns whether they succeeded.
fn same<A: Module, B: Module>(
    what: &str,
    ours: candle_core::Result<A>,
    theirs: candle_core::Result<B>,
    x: &Tensor,
) -> bool {
    match (ours, theirs) {
        (Ok(a), Ok(b)) => {
            match (a.forward(x), b.forward(x)) {
                (Ok(ya), Ok(yb)) => {
                    assert_eq!(ya.dims(), yb.dims(), "{what}");
                    assert_eq!(bits(&ya), bits(&yb), "{what}");
                }
                (Err(_), Err(_)) => {}
                (ya, yb) => panic!(
                    "{what}: forward ours ok = {}, candle-nn ok = {}",
                    ya.is_ok(),
                    yb.is_ok()
                ),
            }
            true
        }
        (Err(_), Err(_)) => false,
        (a, b) => panic!(
            "{what}: built ours ok = {} ({:?}), candle-nn ok = {} ({:?})",
            a.is_ok(),
            a.err().map(|e| e.to_string()),
            b.is_ok(),
            b.err().map(|e| e.to_string())
        ),
    }
}

/// Calls the same constructor of `crate::nn` and of candle-nn, with `ours`/`theirs` prefixed by
/// `path` as the last argument, and compares them on `x`.
macro_rules! parity {
    ($ours:expr, $theirs:expr, $x:expr, $f:ident($($arg:expr),*), $path:expr) => {
        same(
            concat!(stringify!($f), "(", stringify!($($arg),*), ") at ", $path),
            $f($($arg),*, $ours.pp($path)),
            candle_nn::$f($($arg),*, $theirs.pp($path)),
            &$x,
        )
    };
}

#[test]
fn constructors_accept_and_refuse_what_candle_nn_does_and_compute_its_bits() {
    let (o, t) = builders();
    let x2 = uniform_tensor(&[2, 4], 1).unwrap();
    let x3 = uniform_tensor(&[2, 3, 4], 2).unwrap();
    let ids = Tensor::new(&[[1u32, 9, 0], [3, 3, 7]], &Device::Cpu).unwrap();
    let seq = uniform_tensor(&[2, 4, 8], 3).unwrap();
    let img = uniform_tensor(&[1, 4, 5, 5], 4).unwrap();
    let small = uniform_tensor(&[1, 4, 3, 3], 5).unwrap();
    let ln_cfg = |remove_mean, affine| LayerNormConfig {
        eps: 1e-5,
        remove_mean,
        affine,
    };
    let g2_1d = Conv1dConfig {
        groups: 2,
        padding: 1,
        ..Default::default()
    };
    let g2_t1d = ConvTranspose1dConfig {
        groups: 2,
        stride: 2,
        ..Default::default()
    };
    let pad_2d = Conv2dConfig {
        padding: 1,
        ..Default::default()
    };
    let t2d = ConvTranspose2dConfig {
        stride: 2,
        ..Default::default()
    };

    let accepted = [
        parity!(o, t, x2, linear(4, 3), "lin"),
        parity!(o, t, x3, linear(4, 3), "lin"),
        parity!(o, t, x3, linear_no_bias(4, 3), "lin_nb"),
        parity!(o, t, x3, linear_b(4, 3, false), "lin"),
        parity!(o, t, x3, linear_b(4, 3, true), "lin"),
        parity!(o, t, ids, embedding(10, 4), "emb"),
        parity!(o, t, x3, layer_norm(4, 1e-5), "ln"),
        parity!(o, t, x3, layer_norm(4, 1e-5), "lng"),
        parity!(o, t, x3, layer_norm(4, ln_cfg(false, true)), "ln"),
        parity!(o, t, x3, layer_norm(4, ln_cfg(true, false)), "ln"),
        parity!(o, t, x3, layer_norm(4, ln_cfg(false, false)), "rms"),
        parity!(o, t, x3, layer_norm_no_bias(4, 1e-5), "rms"),
        parity!(o, t, x3, rms_norm(4, 1e-6), "rms"),
        parity!(o, t, seq, group_norm(2, 4, 1e-5), "gn"),
        parity!(o, t, seq, conv1d(4, 6, 3, g2_1d), "c1"),
        parity!(o, t, seq, conv1d_no_bias(4, 6, 3, g2_1d), "c1"),
        parity!(o, t, img, conv2d(4, 6, 3, pad_2d), "c2"),
        parity!(o, t, img, conv2d_no_bias(4, 6, 3, pad_2d), "c2"),
        parity!(o, t, seq, conv_transpose1d(4, 6, 3, g2_t1d), "ct1"),
        parity!(o, t, seq, conv_transpose1d_no_bias(4, 6, 3, g2_t1d), "ct1"),
        parity!(o, t, small, conv_transpose2d(4, 6, 3, t2d), "ct2"),
        parity!(o, t, small, conv_transpose2d_no_bias(4, 6, 3, t2d), "ct2"),
    ];
    assert!(accepted.iter().all(|&a| a), "{accepted:?}");

    let refused = [
        parity!(o, t, x3, linear(4, 3), "lin_nb"), // no bias
        parity!(o, t, x3, linear(3, 4), "lin"),    // transposed shape
        parity!(o, t, x3, linear(4, 3), "missing"),
        parity!(o, t, ids, embedding(4, 10), "emb"),
        parity!(o, t, x3, layer_norm(5, 1e-5), "ln"),
        parity!(o, t, x3, layer_norm(4, 1e-5), "rms"), // no bias
        parity!(o, t, x3, rms_norm(4, 1e-6), "missing"),
        parity!(o, t, seq, group_norm(3, 4, 1e-5), "gn"), // 3 does not divide 4
        parity!(o, t, seq, group_norm(2, 4, 1e-5), "rms"), // no bias
        parity!(o, t, seq, conv1d(4, 6, 3, Conv1dConfig::default()), "c1"),
        parity!(o, t, img, conv2d(4, 6, 2, pad_2d), "c2"),
        parity!(
            o,
            t,
            seq,
            conv_transpose1d(4, 6, 3, Default::default()),
            "ct1"
        ),
        parity!(o, t, small, conv_transpose2d(6, 4, 3, t2d), "ct2"),
    ];
    assert!(refused.iter().all(|&a| !a), "{refused:?}");

    // Forwards on a wrong input fail in both.
    let wrong = uniform_tensor(&[2, 5], 6).unwrap();
    parity!(o, t, wrong, linear(4, 3), "lin");
    parity!(o, t, wrong, layer_norm(4, 1e-5), "ln");
}

#[test]
fn non_contiguous_inputs_take_candle_nns_unfused_paths() {
    let (o, t) = builders();
    let x = uniform_tensor(&[4, 3, 2], 7)
        .unwrap()
        .transpose(0, 2)
        .unwrap(); // [2, 3, 4], strided
    assert!(!x.is_contiguous());
    assert!(parity!(o, t, x, rms_norm(4, 1e-6), "rms"));
    assert!(parity!(o, t, x, layer_norm(4, 1e-5), "ln"));
    assert!(parity!(o, t, x, linear(4, 3), "lin"));
}

#[test]
fn zero_groups_are_typed_errors_where_candle_nn_divides_by_zero() {
    let (o, _) = builders();
    let zero_1d = Conv1dConfig {
        groups: 0,
        ..Default::default()
    };
    let err = conv1d(4, 6, 3, zero_1d, o.pp("c1"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("c1.weight") && err.contains("zero groups"),
        "{err}"
    );
    let zero_2d = Conv2dConfig {
        groups: 0,
        ..Default::default()
    };
    assert!(conv2d(4, 6, 3, zero_2d, o.pp("c2")).is_err());
    let zero_t1d = ConvTranspose1dConfig {
        groups: 0,
        ..Default::default()
    };
    assert!(conv_transpose1d(4, 6, 3, zero_t1d, o.pp("ct1")).is_err());
    let err = group_norm(0, 4, 1e-5, o.pp("gn")).unwrap_err().to_string();
    assert!(
        err.contains("gn.weight") && err.contains("0 groups"),
        "{err}"
    );
}

#[test]
fn errors_name_the_model_the_key_and_both_shapes() {
    let (o, _) = builders();
    let err = linear(3, 4, o.pp("lin")).unwrap_err().to_string();
    assert!(
        err.contains("lin.weight") && err.contains("parity") && err.contains("[4, 3]"),
        "{err}"
    );
    let err = embedding(10, 4, o.pp("nope")).unwrap_err().to_string();
    assert!(
        err.contains("nope.weight") && err.contains("parity"),
        "{err}"
    );
}

#[test]
fn var_builder_walks_prefixes_renames_and_reads_like_candle_nn() {
    let (o, t) = builders();
    assert_eq!(o.dtype(), t.dtype());
    assert!(o.device().same_device(t.device()));
    assert_eq!(o.pp("a").pp(0).prefix(), t.pp("a").pp(0).prefix());
    assert_eq!(o.pp("x").set_prefix("lin").prefix(), "lin");
    assert_eq!(o.pp("x").root().prefix(), "");
    for name in ["weight", "bias", "gamma", "nothing"] {
        for prefix in ["lin", "lng", "ln"] {
            assert_eq!(
                o.pp(prefix).contains_tensor(name),
                t.pp(prefix).contains_tensor(name),
                "{prefix}.{name}"
            );
        }
    }
    // A prefix is not a tensor.
    assert!(!o.contains_tensor("lin"));
    let a = o.get((2, 4), "pos").unwrap();
    let b = t.get((2, 4), "pos").unwrap();
    assert_eq!(bits(&a), bits(&b));
    assert!(o.get((4, 2), "pos").is_err() && t.get((4, 2), "pos").is_err());
    assert!(o.get(4, "missing").is_err() && t.get(4, "missing").is_err());
    assert_eq!(bits(&o.get_unchecked("pos").unwrap()), bits(&b));
    let half = o.get_with_hints_dtype((2, 4), "pos", Init::Const(0.), DType::BF16);
    assert_eq!(half.unwrap().dtype(), DType::BF16);

    // Renaming at the root: `dense.*` is read from `lin.*`, and renamings compose.
    let to_lin = |n: &str| n.replace("dense", "lin");
    let (ro, rt) = (o.clone().rename_f(to_lin), t.clone().rename_f(to_lin));
    assert!(ro.contains_tensor("dense.weight") && rt.contains_tensor("dense.weight"));
    let x = uniform_tensor(&[2, 4], 8).unwrap();
    assert!(parity!(ro, rt, x, linear(4, 3), "dense"));
    let twice = ro.rename_f(|n: &str| n.replace("proj", "dense"));
    assert!(twice.contains_tensor("proj.bias"));
}

#[test]
fn get_is_patched_and_cast_and_does_not_enter_the_forward_order() {
    let mut p = patcher();
    let delta = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
    p.add_patch_entries([(
        "pos".to_string(),
        PatchEntry::new(Patch::Diff {
            diff: delta,
            pad: false,
        }),
    )])
    .unwrap();
    let clean = p.model().clean("pos").unwrap().clone();
    let vb = VarBuilder::from_patcher(
        &p,
        OpsMode::ManualCast {
            compute: Dtype::BF16,
        },
    )
    .unwrap();
    assert_eq!(vb.dtype(), DType::BF16);
    let got = vb.get((2, 4), "pos").unwrap();
    assert_eq!(got.dtype(), DType::BF16);
    let want = (clean + 1.0).unwrap().to_dtype(DType::BF16).unwrap();
    let diff = (got.to_dtype(DType::F32).unwrap() - want.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0);
    assert!(p.model().forward_order().0.is_empty());
    // A layer's forward does enter it.
    let l = linear(4, 3, vb.pp("lin")).unwrap();
    l.forward(&uniform_tensor(&[1, 4], 9).unwrap()).unwrap();
    assert_eq!(p.model().forward_order_keys(), ["lin.weight", "lin.bias"]);
}

#[test]
fn owned_layers_and_tied_heads_compute_what_candle_nn_does() {
    let (o, t) = builders();
    let w = uniform_tensor(&[3, 4], 10).unwrap();
    let x = uniform_tensor(&[2, 4], 11).unwrap();
    let ours = Linear::new(w.clone(), None).forward(&x).unwrap();
    let theirs = candle_nn::Linear::new(w, None).forward(&x).unwrap();
    assert_eq!(bits(&ours), bits(&theirs));

    let emb = embedding(10, 4, o.pp("emb")).unwrap();
    let head = Linear::from_embedding(&emb);
    assert!(head.weights().is_some(), "a tied head stays managed");
    let their_emb = candle_nn::embedding(10, 4, t.pp("emb")).unwrap();
    let their_head = candle_nn::Linear::new(their_emb.embeddings().clone(), None);
    assert_eq!(
        bits(&head.forward(&x).unwrap()),
        bits(&their_head.forward(&x).unwrap())
    );
    assert_eq!(bits(&emb.embeddings()), bits(their_emb.embeddings()));
    assert_eq!(emb.hidden_size(), their_emb.hidden_size());
    // Upstream's spelling, `Linear::new` on the fetched table, is adopted: the head fetches the
    // embedding's weight (managed, the same bits); with a bias it is an unmanaged copy, and says
    // so.
    let spelled = Linear::new(emb.embeddings().clone(), None);
    assert!(spelled.weights().is_some(), "the fetched table is adopted");
    assert_eq!(spelled.copies_managed(), None);
    assert_eq!(
        bits(&spelled.forward(&x).unwrap()),
        bits(&their_head.forward(&x).unwrap())
    );
    let bias = uniform_tensor(&[10], 12).unwrap();
    let copied = Linear::new(emb.embeddings(), Some(bias));
    assert!(copied.weights().is_none());
    assert!(
        copied
            .copies_managed()
            .is_some_and(|w| w.contains("emb.weight")),
        "{:?}",
        copied.copies_managed()
    );
    assert_eq!(head.copies_managed(), None);
    let owned = Linear::new(their_emb.embeddings().clone(), None);
    assert_eq!(
        owned.copies_managed(),
        None,
        "a table the caller owns is no copy"
    );
}

#[test]
fn set_patcher_on_the_source_switches_every_layer() {
    let base = patcher();
    let source = OpsSource::new(&base);
    let vb = VarBuilder::from_source(&source, OpsMode::DisableWeightInit).unwrap();
    let l = linear(4, 3, vb.pp("lin")).unwrap();
    let x = uniform_tensor(&[2, 4], 12).unwrap();
    let before = bits(&l.forward(&x).unwrap());
    let mut styled = base.clone();
    let delta = Tensor::ones((3,), DType::F32, &Device::Cpu).unwrap();
    styled
        .add_patch_entries([(
            "lin.bias".to_string(),
            PatchEntry::new(Patch::Diff {
                diff: delta,
                pad: false,
            }),
        )])
        .unwrap();
    vb.source().set_patcher(&styled).unwrap();
    let after = l.forward(&x).unwrap();
    let want = (Tensor::from_vec(
        before
            .iter()
            .map(|&b| f32::from_bits(b))
            .collect::<Vec<_>>(),
        (2, 3),
        &Device::Cpu,
    )
    .unwrap()
        + 1.0)
        .unwrap();
    let diff = (after - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff < 1e-6, "{diff}");
    // Another model is refused.
    assert!(vb.source().set_patcher(&patcher()).is_err());
}

#[test]
fn a_failed_table_fetch_is_try_embeddings_error_and_an_embeddings_panic_naming_the_weight() {
    use crate::trace::{Kind, Trace};
    use tracing_subscriber::layer::SubscriberExt;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("emb.safetensors");
    let table = uniform_tensor(&[10, 4], 1).unwrap();
    crate::weights::save_safetensors(
        &path,
        &[("emb.weight".to_string(), table, Dtype::F32)],
        &crate::weights::SafetensorsOptions::default(),
    )
    .unwrap();
    let tier = crate::weights::HostTier::new(None);
    let model = Model::from_safetensors_lazy("lazy", &[&path], &tier).unwrap();
    let p = ModelPatcher::new(model, DeviceId::Cpu, DeviceId::Cpu);
    let vb = VarBuilder::from_patcher(&p, OpsMode::DisableWeightInit).unwrap();
    let emb = embedding(10, 4, vb.pp("emb")).unwrap();
    // The file changes underneath the lazy model: every fetch of the table fails.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(16)
        .unwrap();

    let cause = emb.try_embeddings().unwrap_err().to_string();
    assert!(cause.contains("emb.weight"), "{cause}");

    // candle-nn's accessor has no error to return: it panics naming the weight, its model and
    // the cause (never an empty table that fails a later op), and logs the same first.
    let trace = Trace::new();
    let subscriber = tracing_subscriber::registry().with(trace.layer());
    let panicked = tracing::subscriber::with_default(subscriber, || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| emb.embeddings()))
    });
    let payload = panicked.expect_err("a failed fetch gives no table");
    let msg = payload
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(
        msg.contains("`emb.weight` of `lazy`")
            && msg.contains(&cause)
            && msg.contains("try_embeddings"),
        "{msg}"
    );
    let records = trace.records();
    let logged = records
        .iter()
        .find(|r| r.kind == Kind::Instant && r.field("weight").is_some())
        .unwrap_or_else(|| panic!("no event names the weight: {records:?}"));
    let field = |name| logged.field(name).map(|v| v.text()).unwrap_or_default();
    assert!(
        field("weight").contains("emb.weight") && field("error") == cause,
        "{logged:?}"
    );
}
