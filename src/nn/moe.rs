//! candle-nn's `moe` on managed experts: [`moe_gemm_gguf`] and [`moe_gemm`] with candle-nn's
//! signatures, so a model file that calls `candle_nn::moe::moe_gemm_gguf` (candle-transformers'
//! `fused_moe::FusedMoeGGUF`, and with it `quantized_qwen3_moe`) ports by its `use` lines.
//!
//! candle-nn's versions are CUDA kernels over one tensor holding every expert
//! (`[n_expert, n, k]`); elsewhere they fail. Here the experts of a stacked GGUF tensor are
//! weights of their own ([`crate::weights::Stack`]), so a call touches only the experts the
//! routing names: each routed expert runs once, as a [`QMatMul`] on the rows routed to it
//! (fetched through the manager like any weight: resident, cached by use, or streamed), its
//! rows scaled by their routing weight when one is given, and the rows put back in pair order.
//! An expert's rows do not depend on which other rows it runs with, so the result is the
//! same bits in every budget. On the CPU it is the computation the CUDA kernel defines, with
//! candle's CPU kernels (candle has none for it); on CUDA an owned stacked candle `QTensor` goes
//! to candle-nn's kernel, and managed experts run one matmul each (candle's quantized kernels:
//! close to the fused kernel's result, not its bits).
//!
//! The routing, as candle-transformers builds it: `topk_ids [tokens, topk]` flattened and sorted
//! by expert gives `experts_ids` (the expert of each pair, ascending) and `sorted_token_ids`
//! (each pair's index `token * topk + j`). Without `topk_weights` the input is one row per
//! token and pair `p` reads row `p / topk`; with them (the down projection) the input is one row
//! per pair and pair `p` is scaled by `topk_weights.flatten()[p]`. The output has one row per
//! pair, in pair order: an empty batch (no rows, no pairs) gives an empty `[0, n]`.

use candle_core::{DType, Module, Result, Tensor};

use crate::error::Error;
use crate::ops::to_candle;
use crate::quantized::{QMatMul, QTensor};

/// The pairs of one call: for each run of pairs routed to one expert, the expert, the input
/// rows it reads and the pairs it writes.
struct Routing {
    runs: Vec<(usize, Vec<u32>, Vec<u32>)>,
    /// Where each pair's row is in the runs' concatenated output.
    position: Vec<u32>,
}

fn routing(
    what: &str,
    input_rows: usize,
    experts: usize,
    sorted_token_ids: &Tensor,
    experts_ids: &Tensor,
    topk: usize,
    per_pair_input: bool,
) -> Result<Routing> {
    let bad = |reason: String| {
        to_candle(Error::BadRouting {
            what: what.to_string(),
            reason,
        })
    };
    // The routing is read back to the host: on a GPU a synchronizing copy.
    crate::lock::check_wait("a read-back of a routing (candle `to_vec1`)");
    let pairs = sorted_token_ids
        .flatten_all()?
        .to_dtype(DType::U32)?
        .to_vec1::<u32>()?;
    let ids = experts_ids
        .flatten_all()?
        .to_dtype(DType::U32)?
        .to_vec1::<u32>()?;
    if pairs.len() != ids.len() {
        return Err(bad(format!(
            "{} sorted token ids for {} expert ids",
            pairs.len(),
            ids.len()
        )));
    }
    if topk == 0 {
        return Err(bad("top-k is 0".into()));
    }
    let expected = if per_pair_input {
        input_rows
    } else {
        input_rows * topk
    };
    if pairs.len() != expected {
        return Err(bad(format!(
            "{} pairs, but {input_rows} input rows at top-{topk} make {expected}",
            pairs.len()
        )));
    }
    let mut position = vec![u32::MAX; pairs.len()];
    let mut runs: Vec<(usize, Vec<u32>, Vec<u32>)> = Vec::new();
    for (i, (&pair, &expert)) in pairs.iter().zip(&ids).enumerate() {
        let expert = expert as usize;
        if expert >= experts {
            return Err(bad(format!(
                "pair {pair} is routed to expert {expert} of {experts}"
            )));
        }
        let slot = position.get_mut(pair as usize).ok_or_else(|| {
            bad(format!(
                "pair index {pair} is beyond the {} pairs",
                pairs.len()
            ))
        })?;
        if *slot != u32::MAX {
            return Err(bad(format!("pair {pair} is routed twice")));
        }
        *slot = i as u32;
        let row = if per_pair_input {
            pair
        } else {
            pair / topk as u32
        };
        match runs.last_mut() {
            Some((e, rows, ps)) if *e == expert => {
                rows.push(row);
                ps.push(pair);
            }
            _ => runs.push((expert, vec![row], vec![pair])),
        }
    }
    Ok(Routing { runs, position })
}

/// Each routed expert's matmul on its rows, the rows scaled by their routing weights when
/// given, put back in pair order.
fn run_experts(
    input: &Tensor,
    routing: &Routing,
    topk_weights: &Option<Tensor>,
    matmul: impl Fn(usize, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let device = input.device();
    let weights = match topk_weights {
        Some(w) => Some(w.flatten_all()?.to_dtype(DType::F32)?),
        None => None,
    };
    let mut outs = Vec::with_capacity(routing.runs.len());
    for (expert, rows, pairs) in &routing.runs {
        let rows = Tensor::new(rows.as_slice(), device)?;
        let x = input.index_select(&rows, 0)?;
        let mut y = matmul(*expert, &x)?;
        if let Some(w) = &weights {
            let pairs = Tensor::new(pairs.as_slice(), device)?;
            let scale = w.index_select(&pairs, 0)?.unsqueeze(1)?;
            y = y.broadcast_mul(&scale.to_dtype(y.dtype())?)?;
        }
        outs.push(y);
    }
    let sorted = Tensor::cat(&outs, 0)?;
    let position = Tensor::new(routing.position.as_slice(), device)?;
    sorted.index_select(&position, 0)
}

/// candle-nn's `moe_gemm_gguf` on quantized experts: `input [tokens, k]` (or `[pairs, k]`
/// with `topk_weights`) times each pair's expert of `weights [n_expert, n, k]` (a stacked
/// GGUF tensor of a managed model, or an owned candle `QTensor`), `[pairs, n]` in f32 (module
/// docs). `is_prefill` and `dtype` choose candle's CUDA kernel and are passed to it where it
/// runs.
///
/// # Errors
/// An input that is not 2-D f32 or does not match the experts' `k` ([`Error::ShapeMismatch`]),
/// routing that does not fit ([`Error::BadRouting`]: an expert out of range, a pair twice or
/// missing, counts that disagree), a weight that is not stacked experts, and the errors of
/// fetching the experts.
#[allow(clippy::too_many_arguments)]
pub fn moe_gemm_gguf(
    input: &Tensor,
    weights: &QTensor,
    topk_weights: &Option<Tensor>,
    sorted_token_ids: &Tensor,
    experts_ids: &Tensor,
    topk: usize,
    is_prefill: bool,
    dtype: DType,
) -> Result<Tensor> {
    let what = weights.key().unwrap_or("owned experts").to_string();
    if input.dtype() != DType::F32 {
        return Err(to_candle(Error::UnsupportedDtype {
            dtype: format!("{:?}", input.dtype()),
            what: format!("the input of moe_gemm_gguf on `{what}` (f32 only, as candle's)"),
        }));
    }
    let (rows, k) = input.dims2()?;
    let &[experts, n, k1] = weights.shape().dims() else {
        return Err(to_candle(Error::ShapeMismatch {
            what: format!("the experts `{what}` of moe_gemm_gguf ([n_expert, n, k])"),
            expected: vec![0, 0, k],
            got: weights.shape().dims().to_vec(),
        }));
    };
    if k != k1 {
        return Err(to_candle(Error::ShapeMismatch {
            what: format!("the input of moe_gemm_gguf on `{what}`"),
            expected: vec![rows, k1],
            got: vec![rows, k],
        }));
    }
    if !weights.is_managed() && input.device().is_cuda() && rows > 0 {
        if let Some(q) = weights.owned() {
            return candle_nn::moe::moe_gemm_gguf(
                input,
                q,
                topk_weights,
                sorted_token_ids,
                experts_ids,
                topk,
                is_prefill,
                dtype,
            );
        }
    }
    let routing = routing(
        &what,
        rows,
        experts,
        sorted_token_ids,
        experts_ids,
        topk,
        topk_weights.is_some(),
    )?;
    if routing.runs.is_empty() {
        return Tensor::zeros((0, n), DType::F32, input.device());
    }
    // The routing names every expert this layer uses: prefetch them (and the layer's later
    // expert matrices) on the lanes while the first computes.
    let routed: Vec<(usize, usize)> = routing.runs.iter().map(|r| (r.0, r.1.len())).collect();
    weights.prefetch_experts(&routed);
    run_experts(input, &routing, topk_weights, |e, x| {
        QMatMul::from_qtensor(weights.expert(e)?)?.forward(x)
    })
}

/// candle-nn's `moe_gemm` on dense experts `weights [n_expert, n, k]`: as [`moe_gemm_gguf`],
/// each routed expert's `x · wᵀ` in the input's dtype (on CUDA candle-nn's kernel, but for an
/// empty batch, which gives `[0, n]` here).
///
/// # Errors
/// As [`moe_gemm_gguf`] (any float input dtype).
pub fn moe_gemm(
    input: &Tensor,
    weights: &Tensor,
    topk_weights: &Option<Tensor>,
    sorted_token_ids: &Tensor,
    experts_ids: &Tensor,
    topk: usize,
    is_prefill: bool,
) -> Result<Tensor> {
    let (rows, k) = input.dims2()?;
    let (experts, n, k1) = weights.dims3()?;
    if k != k1 {
        return Err(to_candle(Error::ShapeMismatch {
            what: "the input of moe_gemm".into(),
            expected: vec![rows, k1],
            got: vec![rows, k],
        }));
    }
    if input.device().is_cuda() && rows > 0 {
        return candle_nn::moe::moe_gemm(
            input,
            weights,
            topk_weights,
            sorted_token_ids,
            experts_ids,
            topk,
            is_prefill,
        );
    }
    let routing = routing(
        "dense experts",
        rows,
        experts,
        sorted_token_ids,
        experts_ids,
        topk,
        topk_weights.is_some(),
    )?;
    if routing.runs.is_empty() {
        return Tensor::zeros((0, n), input.dtype(), input.device());
    }
    run_experts(input, &routing, topk_weights, |e, x| {
        let w = weights.get(e)?.to_dtype(x.dtype())?;
        x.matmul(&w.t()?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Four tokens at top-2 over three experts: pairs `t * 2 + j`, sorted by expert.
    fn routing_of(topk_ids: &[[u32; 2]]) -> (Tensor, Tensor) {
        let flat: Vec<u32> = topk_ids.iter().flatten().copied().collect();
        let t = Tensor::new(flat.as_slice(), &Device::Cpu).unwrap();
        t.sort_last_dim(true).unwrap()
    }

    fn uniform(shape: &[usize], seed: u64) -> Tensor {
        crate::float::uniform_tensor(shape, seed).unwrap()
    }

    #[test]
    fn dense_experts_give_each_pair_its_experts_product_scaled_by_its_weight() {
        let (tokens, k, n, experts) = (4, 8, 5, 3);
        let x = uniform(&[tokens, k], 1);
        let w = uniform(&[experts, n, k], 2);
        let topk_ids = [[2, 0], [1, 2], [0, 1], [2, 1]];
        let topk_w = uniform(&[tokens, 2], 3).affine(1.0, 0.5).unwrap();
        let (experts_ids, sorted) = routing_of(&topk_ids);
        let up = moe_gemm(&x, &w, &None, &sorted, &experts_ids, 2, false).unwrap();
        assert_eq!(up.dims(), &[tokens * 2, n]);
        let down = moe_gemm(
            &up.narrow(1, 0, n).unwrap(),
            &w.narrow(2, 0, n).unwrap(),
            &Some(topk_w.clone()),
            &sorted,
            &experts_ids,
            2,
            false,
        );
        let down = down.unwrap();
        let xs = x.to_vec2::<f32>().unwrap();
        let ws = w.to_vec3::<f32>().unwrap();
        let ups = up.to_vec2::<f32>().unwrap();
        let downs = down.to_vec2::<f32>().unwrap();
        let tw = topk_w.to_vec2::<f32>().unwrap();
        for (t, ids) in topk_ids.iter().enumerate() {
            for (j, &e) in ids.iter().enumerate() {
                let p = t * 2 + j;
                for o in 0..n {
                    let want: f32 = (0..k).map(|i| xs[t][i] * ws[e as usize][o][i]).sum();
                    assert!((ups[p][o] - want).abs() < 1e-5, "pair {p}, out {o}");
                    let want: f32 = (0..n)
                        .map(|i| ups[p][i] * ws[e as usize][o][i])
                        .sum::<f32>()
                        * tw[t][j];
                    assert!((downs[p][o] - want).abs() < 1e-5, "down pair {p}, out {o}");
                }
            }
        }
    }

    #[test]
    fn routing_that_does_not_fit_is_a_typed_error_naming_the_problem() {
        let x = uniform(&[2, 4], 1);
        let w = uniform(&[3, 5, 4], 2);
        let ids = |v: &[u32]| Tensor::new(v, &Device::Cpu).unwrap();
        let cases: [(&[u32], &[u32], &str); 4] = [
            (&[0, 1, 2, 3], &[0, 0, 1, 3], "expert 3 of 3"),
            (&[0, 1, 1, 3], &[0, 0, 1, 2], "pair 1 is routed twice"),
            (
                &[0, 1, 2],
                &[0, 0, 1],
                "3 pairs, but 2 input rows at top-2 make 4",
            ),
            (&[0, 1, 2, 9], &[0, 0, 1, 2], "pair index 9"),
        ];
        for (pairs, experts, want) in cases {
            let err = moe_gemm(&x, &w, &None, &ids(pairs), &ids(experts), 2, false).unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(want) && msg.contains("routing"), "{msg}");
        }
        let err = moe_gemm(
            &x,
            &w.narrow(2, 0, 3).unwrap(),
            &None,
            &ids(&[0, 1, 2, 3]),
            &ids(&[0, 0, 1, 1]),
            2,
            false,
        )
        .unwrap_err();
        assert!(err.to_string().contains("shape mismatch"), "{err}");
    }

    #[test]
    fn an_empty_batch_gives_an_empty_result_with_the_experts_width() {
        let (k, n) = (32, 5);
        let none = Tensor::zeros(0, DType::U32, &Device::Cpu).unwrap();
        let x = Tensor::zeros((0, k), DType::F32, &Device::Cpu).unwrap();
        let w = uniform(&[3, n, k], 2);
        for weights in [
            None,
            Some(Tensor::zeros((0, 2), DType::F32, &Device::Cpu).unwrap()),
        ] {
            let y = moe_gemm(&x, &w, &weights, &none, &none, 2, false).unwrap();
            assert_eq!((y.dims(), y.dtype()), (&[0, n][..], DType::F32));
        }
        let x16 = x.to_dtype(DType::F16).unwrap();
        let y = moe_gemm(&x16, &w, &None, &none, &none, 2, false).unwrap();
        assert_eq!((y.dims(), y.dtype()), (&[0, n][..], DType::F16));
        let q = QTensor::from(
            candle_core::quantized::QTensor::quantize(&w, candle_core::quantized::GgmlDType::Q8_0)
                .unwrap(),
        );
        let y = moe_gemm_gguf(&x, &q, &None, &none, &none, 2, false, DType::F32).unwrap();
        assert_eq!((y.dims(), y.dtype()), (&[0, n][..], DType::F32));
        // Pairs without rows are still routing that does not fit.
        let one = Tensor::new(&[0u32], &Device::Cpu).unwrap();
        let err = moe_gemm(&x, &w, &None, &one, &one, 2, false).unwrap_err();
        assert!(err.to_string().contains("routing"), "{err}");
    }

    #[test]
    fn quantized_experts_need_an_f32_input_and_stacked_weights() {
        let w = candle_core::quantized::QTensor::quantize(
            &uniform(&[2, 4, 32], 2),
            candle_core::quantized::GgmlDType::Q8_0,
        )
        .unwrap();
        let w = QTensor::from(w);
        let ids = Tensor::new(&[0u32, 1], &Device::Cpu).unwrap();
        let x = uniform(&[1, 32], 1).to_dtype(DType::F16).unwrap();
        let err = moe_gemm_gguf(&x, &w, &None, &ids, &ids, 2, false, DType::F32).unwrap_err();
        assert!(err.to_string().contains("f32 only"), "{err}");
        let x = uniform(&[1, 32], 1);
        let y = moe_gemm_gguf(&x, &w, &None, &ids, &ids, 2, false, DType::F32).unwrap();
        assert_eq!(y.dims(), &[2, 4]);
        // Pair 1 is expert 1's product, as its own QMatMul gives it.
        let one = QMatMul::from_qtensor(w.expert(1).unwrap())
            .unwrap()
            .forward(&x)
            .unwrap();
        assert_eq!(
            y.get(1).unwrap().to_vec1::<f32>().unwrap(),
            one.get(0).unwrap().to_vec1::<f32>().unwrap()
        );
        let err = w.expert(2).unwrap_err();
        assert!(
            err.to_string().contains("expert 2 of a tensor of 2"),
            "{err}"
        );
        let flat = QTensor::from(
            candle_core::quantized::QTensor::quantize(
                &uniform(&[4, 32], 3),
                candle_core::quantized::GgmlDType::Q8_0,
            )
            .unwrap(),
        );
        let err = moe_gemm_gguf(&x, &flat, &None, &ids, &ids, 2, false, DType::F32).unwrap_err();
        assert!(err.to_string().contains("[n_expert, n, k]"), "{err}");
    }
}
