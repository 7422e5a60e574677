//! How the backends compute: prepared inputs ([`Ctx`]), masked scores, a plain softmax over query
//! rows (`Naive`, and `Split` one slice at a time) and the online softmax over key chunks
//! (`SubQuadratic`), keeping to at most three score-sized blocks alive, which [`Scratch`]
//! measures. The fused CPU kernel (`Sdpa`) has its own file, `fused.rs`.

use candle_core::{DType, Tensor, D};

use super::fused;
use super::mask::Mask;
use super::plan::{split_slices, subquad_chunks};
use super::Backend;
use crate::error::{Error, Result, TensorContext};
use crate::size::ByteSize;

/// Prepared inputs shared by every chunk.
pub(super) struct Ctx {
    /// `[B, H, Nq, D]`, scaled, in the score dtype.
    pub(super) qs: Tensor,
    /// `[B, H, Nk, D]`, in the score dtype.
    pub(super) k: Tensor,
    /// `[B, H, Nk, Dv]` in the softmax dtype: probabilities are never rounded down for `·V`;
    /// `V` (`O(Nk·Dv)`, not a score block) is cast instead.
    pub(super) v: Tensor,
    /// The output dtype (`V`'s).
    pub(super) out_dtype: DType,
    pub(super) mask: Option<Mask>,
    pub(super) softmax_dtype: DType,
    /// Scalar fill for boolean-masked scores: the softmax dtype's most negative finite value.
    pub(super) fill: Tensor,
    /// The same value as a number.
    pub(super) floor: f64,
}

impl Ctx {
    /// Runs `backend` over every query row: the output `[B, H, Nq, Dv]` and the number of query
    /// and key chunks. `free` is the memory the memory-aware backends plan in.
    pub(super) fn run(
        &self,
        backend: Backend,
        free: ByteSize,
        scratch: &mut Scratch,
    ) -> Result<(Tensor, usize, usize)> {
        let (b, h, nq, _) = self.qs.dims4()?;
        let nk = self.k.dim(2)?;
        let bh = b * h;
        let elem = self.softmax_dtype.size_in_bytes();
        Ok(match backend {
            Backend::Naive => (self.rows(0, nq, scratch)?, 1, 1),
            Backend::Split => {
                let slices = split_slices(bh, nq, nk, elem, free)?;
                let mut outs = Vec::with_capacity(slices);
                for (start, len) in even_ranges(nq, slices) {
                    outs.push(self.rows(start, len, scratch)?);
                }
                (cat_rows(&outs)?, slices, 1)
            }
            Backend::Sdpa => fused::run(self, free, scratch)?,
            _ => {
                let (qc, kc) = subquad_chunks(bh, nq, nk, elem, free);
                let mut outs = Vec::with_capacity(nq.div_ceil(qc));
                for (start, len) in chunk_ranges(nq, qc) {
                    outs.push(self.online(start, len, kc, scratch)?);
                }
                (cat_rows(&outs)?, nq.div_ceil(qc), nk.div_ceil(kc))
            }
        })
    }

    /// Scaled, masked scores `[B, H, qn, kn]` in the softmax dtype. At most three blocks alive.
    fn scores(
        &self,
        q0: usize,
        qn: usize,
        k0: usize,
        kn: usize,
        scratch: &mut Scratch,
    ) -> Result<Tensor> {
        let q = self.qs.narrow(2, q0, qn)?.contiguous()?;
        let k = self.k.narrow(2, k0, kn)?;
        let raw = q.matmul(&k.t()?).ctx(|| "attention: Q·Kᵀ".into())?;
        scratch.live(&[&raw]);
        let s = if raw.dtype() != self.softmax_dtype {
            let s = raw.to_dtype(self.softmax_dtype)?;
            scratch.live(&[&raw, &s]);
            s
        } else {
            raw
        };
        Ok(match &self.mask {
            None => s,
            Some(Mask::Bool(m)) => {
                let m = Mask::chunk(m, q0, qn, k0, kn)?.broadcast_as(s.shape())?;
                let fill = self.fill.broadcast_as(s.shape())?;
                let out = m.where_cond(&s, &fill)?;
                scratch.live(&[&s, &out]);
                out
            }
            Some(Mask::Additive(m)) => {
                let m = Mask::chunk(m, q0, qn, k0, kn)?;
                // A view of the caller's mask costs nothing; a cast chunk is a new block.
                let cast = m.dtype() != self.softmax_dtype;
                let m = if cast {
                    m.to_dtype(self.softmax_dtype)?
                } else {
                    m
                };
                let out = s.broadcast_add(&m)?;
                if cast {
                    scratch.live(&[&s, &m, &out]);
                } else {
                    scratch.live(&[&s, &out]);
                }
                out
            }
        })
    }

    /// Query rows `q0..q0+qn` against every key with a plain softmax: `[B, H, qn, Dv]`.
    fn rows(&self, q0: usize, qn: usize, scratch: &mut Scratch) -> Result<Tensor> {
        let nk = self.k.dim(2)?;
        let s = self.scores(q0, qn, 0, nk, scratch)?;
        let max = s.max_keepdim(D::Minus1)?;
        let t = s.broadcast_sub(&max)?;
        scratch.live(&[&s, &t]);
        drop(s);
        let e = t.exp()?;
        scratch.live(&[&t, &e]);
        drop(t);
        let sum = e.sum_keepdim(D::Minus1)?;
        let p = e.broadcast_div(&sum)?;
        scratch.live(&[&e, &p]);
        drop(e);
        let out = p
            .matmul(&self.v)
            .ctx(|| "attention: probabilities·V".into())?;
        Ok(out.to_dtype(self.out_dtype)?)
    }

    /// Query rows `q0..q0+qn` against key chunks of `kc` with a running maximum and sum.
    fn online(&self, q0: usize, qn: usize, kc: usize, scratch: &mut Scratch) -> Result<Tensor> {
        let nk = self.k.dim(2)?;
        // (running max, running sum, running Σ p·v), all in the softmax dtype.
        let mut state: Option<(Tensor, Tensor, Tensor)> = None;
        for (k0, kn) in chunk_ranges(nk, kc) {
            let s = self.scores(q0, qn, k0, kn, scratch)?;
            let chunk_max = s.max_keepdim(D::Minus1)?;
            // The floor keeps an all `-inf` chunk from producing `-inf - -inf = NaN`.
            let m_new = match &state {
                None => chunk_max.maximum(self.floor)?,
                Some((m, _, _)) => m.maximum(&chunk_max)?,
            };
            let t = s.broadcast_sub(&m_new)?;
            scratch.live(&[&s, &t]);
            drop(s);
            let p = t.exp()?;
            scratch.live(&[&t, &p]);
            drop(t);
            let p_sum = p.sum_keepdim(D::Minus1)?;
            let v = self.v.narrow(2, k0, kn)?.contiguous()?;
            let pv = p
                .matmul(&v)
                .ctx(|| "attention: probabilities·V chunk".into())?;
            drop(p);
            state = Some(match state {
                None => (m_new, p_sum, pv),
                Some((m, l, acc)) => {
                    let alpha = (m - &m_new)?.exp()?;
                    let l = ((l * &alpha)? + p_sum)?;
                    let acc = (acc.broadcast_mul(&alpha)? + pv)?;
                    (m_new, l, acc)
                }
            });
        }
        let (_, l, acc) = state.ok_or_else(|| {
            Error::tensor(
                "attention: sub-quadratic chunking",
                candle_core::Error::Msg("no key chunk".into()),
            )
        })?;
        Ok(acc.broadcast_div(&l)?.to_dtype(self.out_dtype)?)
    }
}

/// Tracks the largest sum of score-sized blocks alive at once.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) peak: u64,
}

impl Scratch {
    /// Records that `blocks` are alive together.
    fn live(&mut self, blocks: &[&Tensor]) {
        let bytes: u64 = blocks
            .iter()
            .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
            .sum();
        self.peak = self.peak.max(bytes);
    }
}

/// `parts` ranges covering `0..n`, the first `n % parts` one row longer.
fn even_ranges(n: usize, parts: usize) -> impl Iterator<Item = (usize, usize)> {
    let parts = parts.clamp(1, n.max(1));
    let (base, extra) = (n / parts, n % parts);
    (0..parts).scan(0, move |start, i| {
        let len = base + usize::from(i < extra);
        let r = (*start, len);
        *start += len;
        Some(r)
    })
}

/// Ranges of `chunk` rows covering `0..n` (the last one shorter).
fn chunk_ranges(n: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunk = chunk.max(1);
    (0..n).step_by(chunk).map(move |s| (s, chunk.min(n - s)))
}

fn cat_rows(parts: &[Tensor]) -> Result<Tensor> {
    if parts.len() == 1 {
        return Ok(parts[0].clone());
    }
    Tensor::cat(parts, 2).ctx(|| "attention: joining query chunks".into())
}

/// The most negative finite value of `dtype`.
pub(super) fn finite_min(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => half::f16::MIN.to_f64(),
        DType::BF16 => half::bf16::MIN.to_f64(),
        DType::F64 => f64::MIN,
        _ => f32::MIN as f64,
    }
}
