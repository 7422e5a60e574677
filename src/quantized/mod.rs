//! Quantized (GGUF) models under the manager: what candle-transformers' quantized models use
//! from `candle_core::quantized`, on managed weights.
//!
//! `use residency::quantized::{gguf_file, QTensor, QMatMul}` in place of candle's: a
//! [`gguf_file::Content`] made from a [`ModelPatcher`] of a model read with
//! [`Model::from_gguf`](crate::weights::Model::from_gguf) hands out [`QTensor`] *handles*
//! (`ct.tensor(reader, name, device)`), and a [`QMatMul`] made from one fetches its weight
//! through the manager at every forward, as [`crate::nn`]'s layers do:
//!
//! - a quantized weight resident and current ⇒ its resident `QTensor` (candle's own kernels);
//!   otherwise its block bytes stream (pins, staging, lanes, prefetch, the host tier: the path
//!   of every weight) and become a `QTensor` on the load device at use. Either way the blocks
//!   are the file's, so streamed and resident give the same bits (I3).
//! - a *patched* quantized weight (a LoRA clone) is used dense, as ComfyUI-GGUF does: its blocks
//!   dequantized to f32, the patches applied, cast to the patcher's compute dtype (f32 when it
//!   has none), multiplied by candle's dense matmul. Resident copies stay the clean blocks (their
//!   fingerprint ignores patches), so switching base ↔ clone moves no quantized weight; the dense
//!   patched weight of a resident one is kept in the model's manual-cast cache when the ledger
//!   has room (dropped first under pressure), so a resident LoRA clone does not dequantize at
//!   every step.
//! - GGUF's dense tensors (F32, F16, BF16) are ordinary dense weights, used in f32 as candle's
//!   `QTensor::dequantize` gives them.
//!
//! A handle can also own a candle `QTensor` (`QTensor::from(candle_qtensor)`): not managed, for
//! code paths such as `ggml_file` models that read their own tensors.
//!
//! Accessors that return dense tensors (`QTensor::dequantize`) fetch now and return a tensor the
//! caller owns: not evicted, not switched by a later patch set, and counted outside the ledger
//! as a `VarBuilder::get` tensor is (`Model::held_outside`) — see `docs/PORTING.md`.

pub mod ggml_file;
pub mod gguf_file;
mod matmul;

pub use matmul::QMatMul;

use std::sync::Arc;

use candle_core::quantized as cq;
use candle_core::{Device, Shape, Tensor};

pub use candle_core::quantized::GgmlDType;

use crate::error::{Error, Result};
use crate::float::Dtype;
use crate::ops::{
    cast_bias_weight, cast_cache_of, to_candle, weight_outside_forward, CastKey, LayerWeights,
    OpsBuilder, OpsMode, OpsSource, Via,
};
use crate::patcher::ModelPatcher;
use crate::weights::ResidentWeight;

/// A quantized tensor: a handle on a weight of a managed model (fetched at use), or a candle
/// `QTensor` owned as candle owns it.
#[derive(Clone, Debug)]
pub struct QTensor {
    inner: Inner,
}

#[derive(Clone, Debug)]
enum Inner {
    Owned(Arc<cq::QTensor>),
    /// A block-quantized weight of a managed model.
    Quantized(Arc<QRef>),
    /// A dense (F32/F16/BF16) weight of a managed model, used in f32.
    Dense(Arc<DenseRef>),
    /// A layer's experts stacked in one GGUF tensor, each expert a weight of its own.
    Stacked(Arc<StackRef>),
}

#[derive(Debug)]
struct StackRef {
    key: String,
    experts: Vec<QTensor>,
    shape: Shape,
    ggml: GgmlDType,
}

#[derive(Debug)]
struct QRef {
    source: OpsSource,
    key: String,
    index: usize,
    shape: Shape,
    ggml: GgmlDType,
}

#[derive(Debug)]
struct DenseRef {
    weights: LayerWeights,
    shape: Shape,
    ggml: GgmlDType,
}

impl From<cq::QTensor> for QTensor {
    fn from(q: cq::QTensor) -> Self {
        QTensor {
            inner: Inner::Owned(Arc::new(q)),
        }
    }
}

impl From<Arc<cq::QTensor>> for QTensor {
    fn from(q: Arc<cq::QTensor>) -> Self {
        QTensor {
            inner: Inner::Owned(q),
        }
    }
}

/// A fetched weight, ready for a forward.
pub(crate) enum Fetched {
    /// Unpatched blocks: candle's quantized kernels.
    Quantized(Arc<cq::QTensor>),
    /// Dense f32 (or the compute dtype): a patched quantized weight, or a dense one.
    Dense(Tensor),
    /// A cost-aware miss run on the host (`--cost-aware-misses`): the clean blocks as a host
    /// `QTensor`, the input to be moved to it.
    Host(Arc<cq::QTensor>, MissNote),
    /// A streamed fetch with cost-aware misses on: the blocks on the device, the matmul timed
    /// for the rule.
    Uploaded(Arc<cq::QTensor>, MissNote),
}

/// What a cost-aware miss's matmul reports its time to.
pub(crate) struct MissNote {
    costs: Arc<crate::offload::MissCosts>,
    ggml: GgmlDType,
    rows: usize,
    bytes: u64,
    /// Whether the run's time is what the next host run of this weight costs: not when the run
    /// multiplies a `QTensor` just built and kept as a prepared copy (candle re-packs its blocks
    /// in that first matmul, the later runs do not).
    timed: bool,
}

impl Fetched {
    /// The weight dense in f32 on `device` (a norm's gain, say).
    pub(crate) fn dense_on(self, device: &Device) -> candle_core::Result<Tensor> {
        match self {
            Fetched::Dense(w) => Ok(w),
            Fetched::Quantized(q) | Fetched::Host(q, _) | Fetched::Uploaded(q, _) => {
                q.dequantize(&q.device())?.to_device(device)
            }
        }
    }
}

/// The format a dense slot of `dtype` has in a GGUF file.
pub(crate) fn ggml_of(dtype: Dtype) -> GgmlDType {
    match dtype {
        Dtype::F16 => GgmlDType::F16,
        Dtype::BF16 => GgmlDType::BF16,
        _ => GgmlDType::F32,
    }
}

impl QTensor {
    /// A handle on weight `key` of the model `source` fetches through.
    ///
    /// # Errors
    /// [`Error::UnknownWeight`] naming model and key.
    pub(crate) fn managed(source: &OpsSource, key: &str) -> Result<QTensor> {
        let patcher = source.patcher();
        let model = patcher.model();
        if let Some(stack) = model.stack(key) {
            let experts = (0..stack.experts().len())
                .map(|e| QTensor::managed(source, &crate::weights::expert_key(key, e)))
                .collect::<Result<Vec<_>>>()?;
            return Ok(QTensor {
                inner: Inner::Stacked(Arc::new(StackRef {
                    key: key.to_string(),
                    experts,
                    shape: Shape::from(stack.shape().to_vec()),
                    ggml: stack.ggml(),
                })),
            });
        }
        let index = model.index_of(key).ok_or_else(|| Error::UnknownWeight {
            model: model.name().to_string(),
            key: key.to_string(),
        })?;
        let slot = &model.slots()[index];
        let shape = Shape::from(slot.shape().to_vec());
        let inner = match slot.quantized() {
            Some(ggml) => Inner::Quantized(Arc::new(QRef {
                source: source.clone(),
                key: key.to_string(),
                index,
                shape,
                ggml,
            })),
            None => {
                let ops = OpsBuilder::from_source(
                    source,
                    OpsMode::ManualCast {
                        compute: Dtype::F32,
                    },
                );
                Inner::Dense(Arc::new(DenseRef {
                    weights: ops.weights_at(key.to_string(), slot.shape(), None)?,
                    shape,
                    ggml: ggml_of(slot.dtype()),
                }))
            }
        };
        Ok(QTensor { inner })
    }

    /// The GGML format (a dense weight of a managed model: its stored F32/F16/BF16).
    pub fn dtype(&self) -> GgmlDType {
        match &self.inner {
            Inner::Owned(q) => q.dtype(),
            Inner::Quantized(r) => r.ggml,
            Inner::Dense(d) => d.ggml,
            Inner::Stacked(s) => s.ggml,
        }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        match &self.inner {
            Inner::Owned(q) => q.shape(),
            Inner::Quantized(r) => &r.shape,
            Inner::Dense(d) => &d.shape,
            Inner::Stacked(s) => &s.shape,
        }
    }

    /// The number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape().rank()
    }

    /// The device it computes on (a managed weight: its patcher's load device).
    ///
    /// # Errors
    /// A load device with no candle device in this build.
    pub fn device(&self) -> candle_core::Result<Device> {
        match &self.inner {
            Inner::Owned(q) => Ok(q.device()),
            Inner::Quantized(r) => r
                .source
                .patcher()
                .weight_device(r.index)
                .to_candle()
                .map_err(to_candle),
            Inner::Dense(d) => {
                let source = d.weights.source();
                let patcher = source.patcher();
                patcher
                    .weight_device(d.weights.weight_index())
                    .to_candle()
                    .map_err(to_candle)
            }
            Inner::Stacked(s) => s.experts[0].device(),
        }
    }

    /// The weight's key in its model, for a managed handle.
    pub fn key(&self) -> Option<&str> {
        match &self.inner {
            Inner::Owned(_) => None,
            Inner::Quantized(r) => Some(&r.key),
            Inner::Dense(d) => Some(d.weights.weight_key()),
            Inner::Stacked(s) => Some(&s.key),
        }
    }

    /// Whether the handle fetches through the manager (not an owned candle `QTensor`).
    pub fn is_managed(&self) -> bool {
        !matches!(self.inner, Inner::Owned(_))
    }

    /// Bytes of its storage: block bytes (a dense weight: its stored bytes).
    pub fn storage_size_in_bytes(&self) -> usize {
        match &self.inner {
            Inner::Owned(q) => q.storage_size_in_bytes(),
            Inner::Quantized(r) => {
                let patcher = r.source.patcher();
                patcher.model().slots()[r.index].bytes().bytes() as usize
            }
            Inner::Dense(d) => {
                let patcher = d.weights.source().patcher();
                let index = patcher.model().index_of(d.weights.weight_key());
                index.map_or(0, |i| patcher.model().slots()[i].bytes().bytes() as usize)
            }
            Inner::Stacked(s) => s.experts.iter().map(QTensor::storage_size_in_bytes).sum(),
        }
    }

    /// The candle `QTensor` an owned handle holds (`None` for a managed one).
    pub fn owned(&self) -> Option<&cq::QTensor> {
        match &self.inner {
            Inner::Owned(q) => Some(q),
            _ => None,
        }
    }

    /// The number of experts of a stacked-expert tensor (`[n_expert, rows, cols]`, a GGUF
    /// `…_exps` tensor): its first dimension; `None` for a tensor of another rank.
    pub fn experts_len(&self) -> Option<usize> {
        match &self.inner {
            Inner::Stacked(s) => Some(s.experts.len()),
            _ if self.rank() == 3 => Some(self.shape().dims()[0]),
            _ => None,
        }
    }

    /// Expert `e` of a stacked-expert tensor, `[rows, cols]`: for a managed model its own
    /// weight (`blk.0.ffn_gate_exps.3.weight`, fetched, cached and evicted alone); for an owned
    /// candle `QTensor` its blocks copied out.
    ///
    /// # Errors
    /// [`Error::BadWeight`] naming the tensor when it is not 3-D or `e` is out of range;
    /// candle's errors copying an owned tensor's blocks.
    pub fn expert(&self, e: usize) -> candle_core::Result<QTensor> {
        let out_of_range = |n: usize| {
            to_candle(Error::BadWeight {
                model: String::new(),
                key: self.key().unwrap_or("an owned QTensor").to_string(),
                reason: format!("expert {e} of a tensor of {n} experts"),
            })
        };
        match &self.inner {
            Inner::Stacked(s) => s
                .experts
                .get(e)
                .cloned()
                .ok_or_else(|| out_of_range(s.experts.len())),
            Inner::Owned(q) => {
                let &[n, rows, cols] = q.shape().dims() else {
                    return Err(to_candle(Error::BadWeight {
                        model: String::new(),
                        key: "an owned QTensor".into(),
                        reason: format!("{:?} is not [experts, rows, cols]", q.shape()),
                    }));
                };
                if e >= n {
                    return Err(out_of_range(n));
                }
                let data = q.data()?;
                let each = data.len() / n;
                let bytes = &data[e * each..(e + 1) * each];
                let q = crate::weights::qtensor_from_slice(
                    bytes,
                    q.dtype(),
                    &[rows, cols],
                    &q.device(),
                )?;
                Ok(QTensor::from(q))
            }
            _ => Err(to_candle(Error::BadWeight {
                model: self.model_name(),
                key: self.key().unwrap_or_default().to_string(),
                reason: format!("{:?} is not a stacked-expert tensor", self.shape()),
            })),
        }
    }

    /// The patcher a managed handle fetches through.
    fn patcher(&self) -> Option<Arc<ModelPatcher>> {
        match &self.inner {
            Inner::Owned(_) => None,
            Inner::Quantized(r) => Some(r.source.patcher()),
            Inner::Dense(d) => Some(d.weights.source().patcher()),
            Inner::Stacked(s) => s.experts[0].patcher(),
        }
    }

    /// Prefetches, on the transfer lanes, experts `experts` of this stacked tensor and of the
    /// layer's stacked tensors after it (`ffn_up_exps`, `ffn_down_exps` after `ffn_gate_exps`):
    /// the routing says which experts the layer uses before the first is computed. The first of
    /// this tensor's is left out (it is fetched at once). `experts`: each expert with the rows
    /// routed to it. Nothing for other handles.
    pub(crate) fn prefetch_experts(&self, experts: &[(usize, usize)]) {
        let Inner::Stacked(s) = &self.inner else {
            return;
        };
        let Some(patcher) = self.patcher() else {
            return;
        };
        let Some(streamer) = crate::offload::streamer_of(&patcher) else {
            return;
        };
        let model = patcher.model();
        let Some(mine) = model.stack(&s.key) else {
            return;
        };
        let layer = crate::patcher::layer_of(&s.key);
        let first = mine.experts().first().copied().unwrap_or(0);
        let mut later: Vec<&crate::weights::Stack> = model
            .stacks()
            .filter(|(name, st)| {
                crate::patcher::layer_of(name) == layer
                    && st.experts().first().copied().unwrap_or(0) > first
            })
            .map(|(_, st)| st)
            .collect();
        later.sort_by_key(|st| st.experts().first().copied());
        let slot = |st: &crate::weights::Stack, (e, rows): (usize, usize)| {
            st.experts().get(e).map(|&i| (i, rows))
        };
        let mut wanted: Vec<(usize, usize)> = experts
            .iter()
            .skip(1)
            .filter_map(|&e| slot(mine, e))
            .collect();
        for st in later {
            wanted.extend(experts.iter().filter_map(|&e| slot(st, e)));
        }
        streamer.prefetch_routed(&patcher, &wanted);
    }

    fn model_name(&self) -> String {
        match &self.inner {
            Inner::Owned(_) => String::new(),
            Inner::Quantized(r) => r.source.patcher().model().name().to_string(),
            Inner::Dense(d) => d.weights.source().patcher().model().name().to_string(),
            Inner::Stacked(s) => s.experts[0].model_name(),
        }
    }

    /// The weight dense in f32 on `device`, as candle's `QTensor::dequantize`. For a managed
    /// weight: fetched now (resident or streamed) with its patches applied; the tensor is the
    /// caller's (not evicted, not switched by a later patch set), so it counts in
    /// [`Model::held_outside`](crate::weights::Model::held_outside) and the ledger as a
    /// `VarBuilder::get` tensor does (`weights/outside.rs`): until the handles fetched through its
    /// source (the `gguf_file::Content` and every layer built from it) are dropped. A second
    /// dequantize of one weight to one device is kept and returned by every later call.
    ///
    /// # Errors
    /// Errors of the fetch, the dequantization or the move.
    pub fn dequantize(&self, device: &Device) -> candle_core::Result<Tensor> {
        self.handed_out(candle_core::DType::F32, device, || {
            self.dequantize_now(device)
        })
    }

    /// [`QTensor::dequantize`] in f16.
    ///
    /// # Errors
    /// As [`QTensor::dequantize`].
    pub fn dequantize_f16(&self, device: &Device) -> candle_core::Result<Tensor> {
        match &self.inner {
            Inner::Owned(q) => q.dequantize_f16(device),
            _ => self.handed_out(candle_core::DType::F16, device, || {
                self.dequantize_now(device)?
                    .to_dtype(candle_core::DType::F16)
            }),
        }
    }

    /// `read()`'s dense copy of this weight in `dtype` on `device`, handed to the caller: counted
    /// outside the ledger for a managed weight (`weights/outside.rs`), as candle's for an owned one.
    fn handed_out(
        &self,
        dtype: candle_core::DType,
        device: &Device,
        read: impl FnOnce() -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        match self.managed_source() {
            Some((source, key)) => source.hand_out(key, dtype, device, Via::Dequantize, read),
            None => read(),
        }
    }

    /// The source a managed handle fetches through, and the key it is counted under.
    fn managed_source(&self) -> Option<(&OpsSource, &str)> {
        match &self.inner {
            Inner::Owned(_) => None,
            Inner::Quantized(r) => Some((&r.source, &r.key)),
            Inner::Dense(d) => Some((d.weights.source(), d.weights.weight_key())),
            Inner::Stacked(s) => Some((s.experts.first()?.managed_source()?.0, &s.key)),
        }
    }

    /// The weight dense in f32 on `device`, fetched now and not counted: for a forward that uses
    /// it and drops it (a bias, a norm's gain).
    pub(crate) fn dequantize_now(&self, device: &Device) -> candle_core::Result<Tensor> {
        let t = match &self.inner {
            Inner::Owned(q) => return q.dequantize(device),
            Inner::Quantized(r) => match r.fetch(false, None).map_err(to_candle)? {
                Fetched::Dense(t) => t.to_dtype(candle_core::DType::F32)?,
                other => other.dense_on(device)?,
            },
            Inner::Dense(d) => weight_outside_forward(
                &d.weights,
                &d.weights
                    .source()
                    .patcher()
                    .weight_device(d.weights.weight_index())
                    .to_candle()
                    .map_err(to_candle)?,
            )
            .map_err(to_candle)?,
            Inner::Stacked(s) => {
                let experts = s
                    .experts
                    .iter()
                    .map(|e| e.dequantize_now(device))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                return Tensor::stack(&experts, 0);
            }
        };
        t.to_device(device)
    }

    /// The weight for a forward on `device` (recorded in the forward order).
    pub(crate) fn fetch_for_forward(&self, device: &Device) -> Result<Fetched> {
        self.fetch_for_matmul(device, None)
    }

    /// [`QTensor::fetch_for_forward`] for a matmul on `rows` input rows (a cost-aware miss may
    /// then run on the host).
    fn fetch_for_matmul(&self, device: &Device, rows: Option<usize>) -> Result<Fetched> {
        match &self.inner {
            Inner::Owned(q) => Ok(Fetched::Quantized(Arc::clone(q))),
            Inner::Quantized(r) => r.fetch(true, rows),
            Inner::Dense(d) => {
                let (w, _) = cast_bias_weight(&d.weights, device, d.weights.mode())?;
                Ok(Fetched::Dense(w))
            }
            Inner::Stacked(s) => Err(Error::BadWeight {
                model: self.model_name(),
                key: s.key.clone(),
                reason: "a stacked-expert tensor is used an expert at a time \
                         (`residency::nn::moe::moe_gemm_gguf`, `QTensor::expert`)"
                    .into(),
            }),
        }
    }

    /// Rows `ids` of a 2-D weight, as candle's `QTensor::embedding` (dequantized rows).
    ///
    /// # Errors
    /// candle's errors, and those of the fetch.
    pub fn embedding(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.on_weight_device(ids, |ids| {
            match self.fetch_for_forward(ids.device()).map_err(to_candle)? {
                Fetched::Quantized(q) | Fetched::Uploaded(q, _) => q.embedding(ids),
                Fetched::Host(q, _) => {
                    crate::lock::check_wait("a read-back of token ids (candle `to_device`)");
                    q.embedding(&ids.to_device(&Device::Cpu)?)?
                        .to_device(ids.device())
                }
                Fetched::Dense(w) => cq::QMatMul::Tensor(w).embedding(ids),
            }
        })
    }

    /// Runs `f` where the weight lives (a split model's remote layer; `crate::ops::split`).
    fn on_weight_device(
        &self,
        x: &Tensor,
        f: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        match &self.inner {
            Inner::Owned(_) => f(x),
            Inner::Quantized(r) => crate::ops::on_device_of(&r.source, r.index, x, to_candle, f),
            Inner::Dense(d) => crate::ops::on_weight_device(&d.weights, x, to_candle, f),
            Inner::Stacked(s) => s.experts[0].on_weight_device(x, f),
        }
    }
}

impl QRef {
    /// The weight for a use: its resident `QTensor` when current, else its blocks streamed and
    /// built on the load device; dense when the patcher patches it (module docs).
    ///
    /// `rows`: the input rows of the matmul it is fetched for; with cost-aware misses on, an
    /// unpatched miss may then run on the host ([`crate::offload::MissCosts`]).
    fn fetch(&self, record: bool, rows: Option<usize>) -> Result<Fetched> {
        let fetched = self.fetch_untimed(record, rows);
        if record && fetched.is_ok() {
            // The weight's compute is timed from here ([`crate::weights::Model::compute_ns`]).
            self.source.patcher().model().note_fetched(self.index);
        }
        fetched
    }

    fn fetch_untimed(&self, record: bool, rows: Option<usize>) -> Result<Fetched> {
        let patcher = self.source.patcher();
        let model = patcher.model();
        if record {
            model.record_use(self.index);
            if let Some(r) = rows {
                model.note_matmul_rows(r);
            }
        }
        let device = patcher.weight_device(self.index);
        let patches = patcher.patches();
        let unpatched = patches.is_empty() || patches.get(&self.key).is_empty();
        let mut note = None;
        let (q, streamed) = match patcher.resident_weight(self.index) {
            Some(ResidentWeight::Quantized(q)) => {
                if model.is_dynamic() {
                    if let Some(s) = crate::offload::streamer_of(&patcher) {
                        s.note_hit(&patcher, self.index);
                    }
                }
                (q, false)
            }
            _ => {
                let blocks = match crate::offload::streamer_of(&patcher) {
                    Some(s) => {
                        let host = rows
                            .filter(|_| unpatched && !device.is_cpu())
                            .map(|r| (self.ggml, r));
                        let bytes = model.slots()[self.index].bytes().bytes();
                        note = host.and_then(|(ggml, rows)| {
                            s.misses().map(|c| MissNote {
                                costs: Arc::clone(c),
                                ggml,
                                rows,
                                bytes,
                                timed: true,
                            })
                        });
                        let host_run = |note: Option<MissNote>| {
                            note.ok_or_else(|| Error::BadWeight {
                                model: model.name().to_string(),
                                key: self.key.clone(),
                                reason: "run on the host without cost-aware misses".into(),
                            })
                        };
                        match s.fetch_for(&patcher, self.index, host)? {
                            crate::offload::Fetch::Device(t) => t,
                            crate::offload::Fetch::Host(clean) => {
                                let note = host_run(note)?;
                                let q = Arc::new(patcher.clean_qtensor(
                                    self.index,
                                    &clean,
                                    &Device::Cpu,
                                )?);
                                let kept = s.offer_prepared(&patcher, self.index, &q);
                                let note = MissNote {
                                    timed: !kept,
                                    ..note
                                };
                                return Ok(Fetched::Host(q, note));
                            }
                            crate::offload::Fetch::Prepared(q) => {
                                return Ok(Fetched::Host(q, host_run(note)?));
                            }
                        }
                    }
                    None => {
                        if record {
                            // A use, not a dequantized copy the caller keeps (a token table
                            // built once: counted outside the ledger, warned about as such).
                            model.note_use_without_load(device);
                        }
                        patcher.materialize(
                            self.index,
                            patcher.resident_dtype(self.index),
                            device,
                        )?
                    }
                };
                let q = patcher.clean_qtensor(self.index, &blocks, &device.to_candle()?)?;
                (Arc::new(q), true)
            }
        };
        // Unpatched (an empty patch set: no key lookup), or patched into the blocks themselves.
        if unpatched || patcher.requantizes(self.index) {
            return Ok(match note.filter(|_| streamed) {
                Some(note) => Fetched::Uploaded(q, note),
                None => Fetched::Quantized(q),
            });
        }
        dense_patched(&patcher, self.index, &q, streamed).map(Fetched::Dense)
    }
}

/// A patched quantized weight dense: from the manual-cast cache when its resident copy is
/// current and the cache holds (or can keep) it, else built now.
fn dense_patched(
    patcher: &ModelPatcher,
    index: usize,
    q: &cq::QTensor,
    streamed: bool,
) -> Result<Tensor> {
    let compute = patcher.resident_dtype(index);
    let build = || patcher.dequantized_patched(index, q, compute);
    let cache = if streamed {
        None
    } else {
        cast_cache_of(patcher.model())
    };
    match cache {
        Some(cache) if cache.device() == patcher.weight_device(index) => {
            let key = CastKey {
                generation: patcher.model().residency_generation(),
                fingerprint: patcher.patch_fingerprint(index, compute),
                compute,
                scale: None,
            };
            cache.get_or_cast(index, key, build)
        }
        _ => build(),
    }
}

/// The [`QTensor`] handles of a patcher's weights, by key (for builders).
pub(crate) fn handle(patcher_source: &OpsSource, key: &str) -> candle_core::Result<QTensor> {
    QTensor::managed(patcher_source, key).map_err(to_candle)
}

/// The candle device of `patcher`'s load device.
pub(crate) fn load_device(patcher: &ModelPatcher) -> candle_core::Result<Device> {
    patcher.load_device().to_candle().map_err(to_candle)
}
