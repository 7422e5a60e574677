//! The fused CPU attention kernel, [`Backend::Sdpa`](super::Backend::Sdpa) on the CPU:
//! flash-style tiles of [`FUSED_TILE_Q`](super::FUSED_TILE_Q) queries against tiles of
//! [`FUSED_TILE_K`](super::FUSED_TILE_K) keys with an online softmax, never a score matrix.
//!
//! # Algorithm
//!
//! One task is one (batch·head, query tile). It keeps a running maximum `m`, a running sum `l`
//! and an output accumulator `O` per query row, and walks the key tiles in order:
//! `S = Q·Kᵀ`, rounding and masking `S` as the other backends do, then [`softmax_tile`] turns
//! `S` into `P = exp(S - m')` and gives the factor `alpha = exp(m - m')`, `O ← alpha·O + P·V`,
//! and finally `O / l` (`rows.rs` holds the row kernels). The two tile products are this
//! crate's own AVX-512 blocks where the CPU has AVX-512 (`products.rs`: the keys are packed
//! once per call, a transposed copy the size of `K`, and nothing is packed per tile), and `gemm`
//! calls elsewhere. Tasks run in parallel on rayon's pool; each holds one score tile
//! (`FUSED_TILE_Q · FUSED_TILE_K · 4` bytes = 256 KiB), so the temporaries are
//! `O(threads · tile²)` whatever the sequence length.
//!
//! # Determinism
//!
//! The tile sizes are constants and a task runs its key tiles in order on one thread with
//! single-threaded `gemm` calls, so the output bits do not depend on free memory, the thread
//! count or the schedule. Free memory only caps how many tasks run at once
//! ([`fused_plan`](super::fused_plan)).
//! (ComfyUI's attention output changes with free VRAM; this one does not, which extends I3 to
//! attention.) The bits may differ between CPUs: the products are AVX-512 blocks or `gemm`
//! calls, and `gemm` picks its kernels by instruction set.
//!
//! # Precision and the upcast rules
//!
//! The tiles compute in `f32` for every input dtype (the CPU has no faster half arithmetic):
//! inputs are read in the dtypes the other backends prepare (`Q`, `K` in the score dtype, `V` in
//! the softmax dtype, see [`Upcast`](super::Upcast)) and widened once. Scores are rounded to the
//! score dtype when that is `f16`/`bf16` (so `f16` scores overflow to `inf` without
//! [`Upcast::Force`](super::Upcast::Force), as in the other backends), and after an additive mask
//! to a half softmax dtype ([`Upcast::Never`](super::Upcast::Never)); the softmax and `P·V` then
//! stay in `f32`, which is at least as precise as the other backends. `f64` inputs never get here
//! ([`runnable`](super::dispatch) runs them as `SubQuadratic`).
//!
//! A boolean mask fills masked scores with the softmax dtype's most negative finite value and
//! the running maximum starts there, so a fully masked row averages `V` uniformly and a row of
//! `-inf` additive scores is NaN, as in the other backends.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{CpuStorage, DType, Storage, StorageRef, Tensor};
use gemm::{gemm, Parallelism};
use rayon::prelude::*;

use super::backends::{Ctx, Scratch};
use super::mask::Mask;
use super::plan::{fused_plan, AttentionShape};
use super::products::{pack_keys, packed_len, Avx512, PANEL};
use super::rows::{add_row, mask_bool_row, normalize_rows, scale_rows, softmax_tile, Half};
use crate::error::{Error, Result, TensorContext};
use crate::size::ByteSize;

/// Runs the fused kernel over `ctx`: the output `[B, H, Nq, Dv]` in the output dtype, and the
/// query tiles per head and key tiles per query tile.
pub(super) fn run(
    ctx: &Ctx,
    free: ByteSize,
    scratch: &mut Scratch,
) -> Result<(Tensor, usize, usize)> {
    let (b, h, nq, d) = ctx.qs.dims4()?;
    let nk = ctx.k.dim(2)?;
    let dv = ctx.v.dim(3)?;
    let shape = AttentionShape {
        batch_heads: b * h,
        nq,
        nk,
        elem_bytes: 4,
    };
    let plan = fused_plan(&shape, free, rayon::current_num_threads());
    let tiles = (nq.div_ceil(plan.tile_q), nk.div_ceil(plan.tile_k));
    if dv == 0 {
        let out = Tensor::zeros((b, h, nq, 0), ctx.out_dtype, ctx.qs.device())?;
        return Ok((out, tiles.0, tiles.1));
    }

    let widen = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F32)?.contiguous()?) };
    let (q, k, v) = (widen(&ctx.qs)?, widen(&ctx.k)?, widen(&ctx.v)?);
    let mask = match &ctx.mask {
        None => None,
        Some(Mask::Bool(m)) => Some((m.contiguous()?, false)),
        // Rounded to the softmax dtype first, as the other backends add it.
        Some(Mask::Additive(m)) => Some((
            m.to_dtype(ctx.softmax_dtype)?
                .to_dtype(DType::F32)?
                .contiguous()?,
            true,
        )),
    };
    let (q_held, k_held, v_held) = (Held::new(&q)?, Held::new(&k)?, Held::new(&v)?);
    let mask_held = mask.as_ref().map(|(m, _)| Held::new(m)).transpose()?;
    let mask_view = match (&mask, &mask_held) {
        (Some((m, additive)), Some(held)) => Some(MaskView {
            values: if *additive {
                MaskValues::Additive(held.f32()?)
            } else {
                MaskValues::Bool(held.u8()?)
            },
            strides: broadcast_strides(m.dims())?,
        }),
        _ => None,
    };
    let (q, k) = (q_held.f32()?, k_held.f32()?);
    let avx512 = Avx512::detect();
    let head_keys = packed_len(nk, d);
    let mut packed = Vec::new();
    if avx512.is_some() && head_keys > 0 {
        packed = vec![0f32; b * h * head_keys];
        packed
            .par_chunks_mut(head_keys)
            .zip(k.par_chunks(nk * d))
            .for_each(|(out, keys)| pack_keys(keys, d, out));
    }
    let kernel = Kernel {
        q,
        k,
        products: avx512.map(|isa| Products {
            isa,
            keys: &packed,
            head_keys,
        }),
        v: v_held.f32()?,
        heads: h,
        nq,
        nk,
        d,
        dv,
        tile_k: plan.tile_k,
        mask: mask_view,
        score_round: Half::of(ctx.qs.dtype()),
        mask_round: match ctx.mask {
            Some(Mask::Additive(_)) => Half::of(ctx.softmax_dtype),
            _ => None,
        },
        floor: ctx.floor as f32,
    };

    let mut out = vec![0f32; b * h * nq * dv];
    let peak = run_tiles(&kernel, &mut out, &plan);
    scratch.peak = scratch.peak.max(peak);
    drop((q_held, k_held, v_held, mask_held));

    let out = Tensor::from_vec(out, (b, h, nq, dv), ctx.qs.device())
        .ctx(|| "attention: the fused kernel's output".into())?
        .to_dtype(ctx.out_dtype)?;
    Ok((out, tiles.0, tiles.1))
}

/// Runs `kernel` over every query tile of `out` (`[batch·heads, nq, dv]`, tiles of
/// `plan.tile_q` rows) on rayon's threads — at most `plan.workers` tiles alive at once — and
/// returns the peak scratch the workers held.
fn run_tiles(kernel: &Kernel<'_>, out: &mut [f32], plan: &super::plan::FusedPlan) -> u64 {
    let (nq, dv) = (kernel.nq, kernel.dv);
    let tasks: Vec<Task<'_>> = out
        .chunks_mut(nq * dv)
        .enumerate()
        .flat_map(|(bh, head)| {
            head.chunks_mut(plan.tile_q * dv)
                .enumerate()
                .map(move |(t, out)| Task {
                    bh,
                    q0: t * plan.tile_q,
                    out,
                })
        })
        .collect();
    let meter = Meter::default();
    let new_worker = || Worker::new(plan.tile_q, plan.tile_k, dv, &meter);
    if plan.workers >= rayon::current_num_threads() {
        tasks
            .into_par_iter()
            .for_each_init(new_worker, |w, task| kernel.run_task(task, w));
    } else {
        // Fewer tiles alive than threads: `workers` strands, each running its tasks in turn.
        let mut strands: Vec<Vec<Task<'_>>> = (0..plan.workers).map(|_| Vec::new()).collect();
        for (i, task) in tasks.into_iter().enumerate() {
            strands[i % plan.workers].push(task);
        }
        strands.into_par_iter().for_each(|strand| {
            let mut w = new_worker();
            for task in strand {
                kernel.run_task(task, &mut w);
            }
        });
    }
    meter.peak.load(Ordering::Relaxed)
}

/// One unit of parallel work: the query tile starting at row `q0` of batch·head `bh`, and its
/// output rows.
struct Task<'o> {
    bh: usize,
    q0: usize,
    /// `rows · dv` values.
    out: &'o mut [f32],
}

/// Everything a task reads, shared by all tasks.
struct Kernel<'a> {
    /// `[BH, Nq, D]`, scaled.
    q: &'a [f32],
    /// `[BH, Nk, D]`.
    k: &'a [f32],
    /// `[BH, Nk, Dv]`.
    v: &'a [f32],
    /// The AVX-512 tile products and the keys packed for them, where the CPU has AVX-512;
    /// `gemm` otherwise.
    products: Option<Products<'a>>,
    heads: usize,
    nq: usize,
    nk: usize,
    d: usize,
    dv: usize,
    tile_k: usize,
    mask: Option<MaskView<'a>>,
    /// Rounding of `Q·Kᵀ` to a half score dtype.
    score_round: Option<Half>,
    /// Rounding of masked scores to a half softmax dtype (additive masks only).
    mask_round: Option<Half>,
    /// The running maximum's start, and a boolean mask's fill: the softmax dtype's most negative
    /// finite value.
    floor: f32,
}

/// The AVX-512 tile products (`products.rs`) and the keys they read.
#[derive(Clone, Copy)]
struct Products<'a> {
    isa: Avx512,
    /// Every head's keys packed by [`pack_keys`], `head_keys` values each.
    keys: &'a [f32],
    head_keys: usize,
}

/// A mask as the kernel reads it: its values, contiguous in the mask's own (broadcast) shape.
struct MaskView<'a> {
    values: MaskValues<'a>,
    /// Element strides along (batch, head, query, key); 0 along broadcast dimensions.
    strides: [usize; 4],
}

enum MaskValues<'a> {
    Bool(&'a [u8]),
    Additive(&'a [f32]),
}

/// One worker's buffers, reused across the tasks it runs.
struct Worker<'m> {
    /// The score tile, `tile_q · tile_k`.
    scores: Vec<f32>,
    /// The output accumulator, `tile_q · dv`.
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    alpha: Vec<f32>,
    meter: &'m Meter,
}

impl<'m> Worker<'m> {
    fn new(tile_q: usize, tile_k: usize, dv: usize, meter: &'m Meter) -> Self {
        let scores = vec![0f32; tile_q * tile_k];
        meter.acquire(byte_len(&scores));
        Worker {
            scores,
            acc: vec![0f32; tile_q * dv],
            max: vec![0f32; tile_q],
            sum: vec![0f32; tile_q],
            alpha: vec![0f32; tile_q],
            meter,
        }
    }
}

impl Drop for Worker<'_> {
    fn drop(&mut self) {
        self.meter.release(byte_len(&self.scores));
    }
}

fn byte_len(v: &[f32]) -> u64 {
    std::mem::size_of_val(v) as u64
}

/// Score-tile bytes alive now and at most, measured on the buffers workers create.
#[derive(Default)]
struct Meter {
    live: AtomicU64,
    peak: AtomicU64,
}

impl Meter {
    fn acquire(&self, bytes: u64) {
        let live = self.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(live, Ordering::Relaxed);
    }

    fn release(&self, bytes: u64) {
        self.live.fetch_sub(bytes, Ordering::Relaxed);
    }
}

impl Kernel<'_> {
    fn run_task(&self, task: Task<'_>, w: &mut Worker<'_>) {
        let (d, dv) = (self.d, self.dv);
        let rows = task.out.len() / dv;
        let q = &self.q[(task.bh * self.nq + task.q0) * d..][..rows * d];
        let k_head = &self.k[task.bh * self.nk * d..][..self.nk * d];
        let v_head = &self.v[task.bh * self.nk * dv..][..self.nk * dv];
        let (max, sum, alpha) = (&mut w.max[..rows], &mut w.sum[..rows], &mut w.alpha[..rows]);
        max.fill(self.floor);
        sum.fill(0.0);
        let acc = &mut w.acc[..rows * dv];
        for (t, k0) in (0..self.nk).step_by(self.tile_k).enumerate() {
            let cols = self.tile_k.min(self.nk - k0);
            let scores = &mut w.scores[..rows * cols];
            match self.products {
                Some(f) => {
                    debug_assert_eq!(k0 % PANEL, 0, "key tiles start on a packed panel");
                    let panels = &f.keys[task.bh * f.head_keys + k0 * d..];
                    f.isa.scores(q, d, panels, cols, scores);
                }
                None => score_tile(q, &k_head[k0 * d..][..cols * d], d, cols, scores),
            }
            self.prepare_scores(scores, cols, &task, k0);
            match self.products {
                Some(f) => f.isa.softmax_tile(scores, cols, max, sum, alpha),
                None => softmax_tile(scores, cols, max, sum, alpha),
            }
            let values = &v_head[k0 * dv..][..cols * dv];
            match self.products {
                Some(f) => f
                    .isa
                    .accumulate(scores, cols, values, dv, alpha, t == 0, acc),
                None => {
                    if t > 0 {
                        scale_rows(acc, dv, alpha);
                    }
                    value_tile(scores, cols, values, dv, t == 0, acc);
                }
            }
        }
        normalize_rows(acc, sum, dv, task.out);
    }

    /// Rounds and masks the raw scores of the task's rows against keys `k0..k0+cols`.
    fn prepare_scores(&self, scores: &mut [f32], cols: usize, task: &Task<'_>, k0: usize) {
        if let Some(half) = self.score_round {
            half.round(scores);
        }
        let Some(mask) = &self.mask else {
            return;
        };
        let [sb, sh, sq, sk] = mask.strides;
        let head = (task.bh / self.heads) * sb + (task.bh % self.heads) * sh;
        for (i, row) in scores.chunks_exact_mut(cols).enumerate() {
            let start = head + (task.q0 + i) * sq + k0 * sk;
            match (&mask.values, sk) {
                (MaskValues::Bool(m), 0) => {
                    if m[start] == 0 {
                        row.fill(self.floor);
                    }
                }
                (MaskValues::Bool(m), _) => mask_bool_row(row, &m[start..][..cols], self.floor),
                (MaskValues::Additive(m), 0) => row.iter_mut().for_each(|x| *x += m[start]),
                (MaskValues::Additive(m), _) => add_row(row, &m[start..][..cols]),
            }
        }
        if let (Some(half), MaskValues::Additive(_)) = (self.mask_round, &mask.values) {
            half.round(scores);
        }
    }
}

/// `S = Q·Kᵀ` for one tile on CPUs without AVX-512: `rows = scores.len() / cols` queries of `q`
/// against the `cols` keys of `keys` (`cols · d` values, row-major), through `gemm`.
fn score_tile(q: &[f32], keys: &[f32], d: usize, cols: usize, scores: &mut [f32]) {
    let rows = scores.len() / cols.max(1);
    assert!(q.len() >= rows.saturating_mul(d) && keys.len() >= cols.saturating_mul(d));
    // SAFETY: `gemm` reads `rows × d` values of `q` (row stride d, column stride 1), `d × cols`
    // of the transposed key tile (`keys`, `cols × d` values, read with row stride 1 and column
    // stride d) and writes `rows × cols` values of `scores` (row stride `cols`), all in bounds
    // (checked above); `scores` is the worker's own buffer and overlaps neither input. It reads
    // no destination value (`read_dst` false).
    unsafe {
        gemm(
            rows,
            cols,
            d,
            scores.as_mut_ptr(),
            1,
            cols as isize,
            false,
            q.as_ptr(),
            1,
            d as isize,
            keys.as_ptr(),
            d as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// `O ← O + P·V` (or `O = P·V` when `first`) for one tile on CPUs without AVX-512: the
/// `rows = acc.len() / dv` rows of `acc`, `cols` probabilities per row of `p`, `cols` rows of
/// `values`, through `gemm`.
fn value_tile(p: &[f32], cols: usize, values: &[f32], dv: usize, first: bool, acc: &mut [f32]) {
    let rows = acc.len() / dv.max(1);
    assert!(p.len() >= rows.saturating_mul(cols) && values.len() >= cols.saturating_mul(dv));
    // SAFETY: `gemm` reads `rows × cols` probabilities of `p` (row stride `cols`), `cols × dv`
    // values (row stride dv) and reads and writes `rows × dv` values of `acc` (row stride dv),
    // all in bounds (checked above); `acc` is the worker's own buffer and overlaps neither
    // input. The first tile does not read `acc` (`read_dst` false).
    unsafe {
        gemm(
            rows,
            dv,
            cols,
            acc.as_mut_ptr(),
            1,
            dv as isize,
            !first,
            p.as_ptr(),
            1,
            cols as isize,
            values.as_ptr(),
            1,
            dv as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// Contiguous strides of a 4-d mask of `dims`, 0 along dimensions of size 1 (broadcast).
fn broadcast_strides(dims: &[usize]) -> Result<[usize; 4]> {
    let &[b, h, q, k] = dims else {
        return Err(Error::ShapeMismatch {
            what: "attention mask (4-d after broadcasting)".into(),
            expected: vec![0; 4],
            got: dims.to_vec(),
        });
    };
    let along = |size: usize, stride: usize| if size == 1 { 0 } else { stride };
    Ok([
        along(b, h * q * k),
        along(h, q * k),
        along(q, k),
        along(k, 1),
    ])
}

/// A contiguous CPU tensor's storage, read-locked while the kernel reads it.
struct Held<'t> {
    storage: StorageRef<'t>,
    range: Range<usize>,
}

impl<'t> Held<'t> {
    fn new(t: &'t Tensor) -> Result<Self> {
        let (storage, layout) = t.storage_and_layout();
        let range = layout
            .contiguous_offsets()
            .map(|(start, end)| start..end)
            .ok_or_else(|| Error::ShapeMismatch {
                what: "attention: a contiguous input for the fused kernel".into(),
                expected: t.dims().to_vec(),
                got: t.stride().to_vec(),
            })?;
        Ok(Held { storage, range })
    }

    fn f32(&self) -> Result<&[f32]> {
        match &*self.storage {
            Storage::Cpu(CpuStorage::F32(v)) => Ok(&v[self.range.clone()]),
            other => Err(unexpected(other, "f32")),
        }
    }

    fn u8(&self) -> Result<&[u8]> {
        match &*self.storage {
            Storage::Cpu(CpuStorage::U8(v)) => Ok(&v[self.range.clone()]),
            other => Err(unexpected(other, "u8")),
        }
    }
}

fn unexpected(storage: &Storage, wanted: &str) -> Error {
    Error::UnsupportedDtype {
        dtype: format!("{:?} on {:?}", storage.dtype(), storage.device().location()),
        what: format!("the fused CPU attention kernel (reads {wanted} CPU tensors)"),
    }
}
