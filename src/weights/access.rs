//! A [`Model`]'s accessors: its weights and their residency, the host tier, derived data and
//! hooks, use statistics and the forward order.

use super::*;

impl Model {
    /// The host tier holding this model's host copies (a model read lazily) or pins.
    pub fn host_tier(&self) -> Option<&HostTier> {
        self.host.get()
    }

    /// Whether the model was read lazily (its weights stay in their files until needed).
    pub fn is_lazy(&self) -> bool {
        self.slots.iter().any(Slot::is_lazy)
    }

    /// Page-locks `clean`, the host copy of weight `index`, in place through `tier` when its pin
    /// budget allows (see [`HostTier`]); `None` when it cannot, and the weight is then staged. A
    /// model pins through one tier: the one it was read through, else the first it pinned in.
    pub(crate) fn pin_clean(
        &self,
        index: usize,
        tier: &HostTier,
        clean: &Tensor,
    ) -> Option<Arc<PinnedWeight>> {
        if self.host.get().is_none() {
            let mut st = self.state.write();
            if self.host.set(tier.clone()).is_ok() {
                st.host = Some((tier.clone(), self.id));
            }
        }
        let ours = self.host.get().filter(|t| t.same(tier))?;
        let lazy = self.slots.get(index)?.is_lazy();
        // A weight resident on a GPU is not pinned: its uses copy nothing from the host.
        if let Some(SlotResidency::Resident { device, .. }) = self.state.read().slots.get(index) {
            if !device.is_cpu() {
                return None;
            }
        }
        ours.try_pin(self.id, index, clean, lazy)
    }

    /// The pin of weight `index`'s clean host copy, when it is page-locked in place now (any copy
    /// from those bytes must be recorded in it).
    pub(crate) fn existing_pin(&self, index: usize) -> Option<Arc<PinnedWeight>> {
        self.host.get()?.pin_of(self.id, index)
    }

    /// Whether the model is loaded whole or not at all: every load makes every weight resident
    /// (whatever the state, `--novram` included) and eviction unloads it completely. Set by
    /// [`crate::managed::Managed`], whose module holds the resident copies themselves.
    pub fn is_whole(&self) -> bool {
        self.whole.load(Ordering::Relaxed)
    }

    /// Whether a weight of this model was fetched for a GPU while the model was not loaded there
    /// (no resident copy and no streamer: every weight then copies from host memory at every use,
    /// through pageable copies). Warned about once per model.
    pub fn used_without_load(&self) -> bool {
        self.used_unloaded.load(Ordering::Relaxed)
    }

    /// Notes a fetch for `device` of a model that is not loaded there: warns once per model.
    /// Loading on first use instead was rejected: a patcher is not tied to a manager (the global
    /// one may not be the engine's), and a forward should not evict other models behind the
    /// engine's back.
    pub(crate) fn note_use_without_load(&self, device: DeviceId) {
        if device.is_cpu() || self.used_unloaded.swap(true, Ordering::Relaxed) {
            return;
        }
        let text = format!(
            "`{}` is used on {device} without `load_models_gpu`: every weight is copied from host memory at every use; load it before running",
            self.name()
        );
        tracing::warn!(model = self.name(), %device, "{text}");
        crate::warnings::echo(&format!("unloaded:{}", self.name()), || text);
    }

    /// Parameters the model's code holds as its own tensors, outside the ledger: handed out by
    /// [`crate::nn::VarBuilder::get`] and not adopted by a layer constructor, by key with their
    /// bytes (they are never evicted, streamed or counted; [`crate::nn::VarBuilder::get_managed`]
    /// keeps such a parameter managed).
    pub fn held_outside(&self) -> Vec<(String, ByteSize)> {
        super::outside::outside_of(self.id)
    }

    /// Warns, once per model, that its code holds `outside` (`bytes` in all) outside the ledger.
    pub(crate) fn warn_outside_once(&self, outside: &[(String, ByteSize)], bytes: ByteSize) {
        if self.warned_outside.swap(true, Ordering::Relaxed) {
            return;
        }
        let text = self.outside_warning(outside, bytes);
        tracing::warn!(model = self.name(), %bytes, "{text}");
        crate::warnings::echo(&format!("outside:{}", self.name()), || text);
    }

    /// The warning about `outside` (`bytes` in all) held outside the ledger, with the cure that
    /// fits how the code got them.
    pub(crate) fn outside_warning(
        &self,
        outside: &[(String, ByteSize)],
        bytes: ByteSize,
    ) -> String {
        let keys: Vec<&str> = outside.iter().take(8).map(|(k, _)| k.as_str()).collect();
        let more = outside.len().saturating_sub(keys.len());
        // A quantized weight held outside was dequantized by the model's code (a port of
        // candle-transformers' `quantized_llama` does it to its token table): the cure is a
        // layer on its blocks, not a VarBuilder call.
        let quantized = outside.iter().any(|(k, _)| {
            self.index_of(k)
                .is_some_and(|i| self.slots()[i].quantized().is_some())
        });
        let cure = if quantized {
            "build the layer on the blocks instead of a dequantized copy (quantized_nn::Embedding::from_qtensor for a token table: docs/PORTING.md, a quantized port)"
        } else {
            "build its layers from them with Linear::new / RmsNorm::new / LayerNorm::new on the tensors VarBuilder::get returned, or read them with VarBuilder::get_managed"
        };
        format!(
            "model `{}` keeps {bytes} of its weights as its own tensors, outside the ledger (never evicted, streamed or budgeted): {}{}; {cure}",
            self.name(),
            keys.join(", "),
            if more > 0 { format!(" and {more} more") } else { String::new() }
        )
    }

    /// Notes that a manager loaded the model for a patcher whose patch set has `version`.
    pub(crate) fn note_loaded_patches(&self, version: u64) {
        self.loaded_patches
            .store(version.saturating_add(1), Ordering::Relaxed);
    }

    /// The patch-set version of the patcher last loaded by a manager (`None`: never loaded).
    pub(crate) fn loaded_patches(&self) -> Option<u64> {
        match self.loaded_patches.load(Ordering::Relaxed) {
            0 => None,
            v => Some(v - 1),
        }
    }

    /// Whether a manager in dynamic mode loaded the model (its weights become resident by use,
    /// docs/ARCHITECTURE.md §5.3).
    pub fn is_dynamic(&self) -> bool {
        self.dynamic.load(Ordering::Relaxed)
    }

    pub(crate) fn set_dynamic(&self, dynamic: bool) {
        self.dynamic.store(dynamic, Ordering::Relaxed);
    }

    pub(crate) fn set_whole(&self, whole: bool) {
        self.whole.store(whole, Ordering::Relaxed);
    }

    /// The value built from the resident copies under `key`, if the residency has not changed
    /// since it was built.
    pub(crate) fn derived(&self, key: u64) -> Option<Arc<dyn Any + Send + Sync>> {
        let generation = self.residency_generation();
        let d = self.derived.lock();
        d.as_ref()
            .filter(|d| d.generation == generation && d.key == key)
            .map(|d| Arc::clone(&d.value))
    }

    /// Keeps `value`, built from the resident copies of `generation` under `key`, unless the
    /// residency changed meanwhile. Returns the value it replaced (to drop outside any lock).
    pub(crate) fn set_derived(
        &self,
        generation: u64,
        key: u64,
        value: Arc<dyn Any + Send + Sync>,
    ) -> Option<Arc<dyn Any + Send + Sync>> {
        if self.residency_generation() != generation {
            return Some(value);
        }
        let old = self.derived.lock().replace(Derived {
            generation,
            key,
            value,
        });
        old.map(|d| d.value)
    }

    /// Takes the derived value out when the residency changed since it was built (an eviction, a
    /// clone switch): the caller drops it, outside its locks, so the copies it held are freed as
    /// the ledger already says they are.
    pub(crate) fn take_stale_derived(&self) -> Option<Arc<dyn Any + Send + Sync>> {
        let generation = self.residency_generation();
        let mut d = self.derived.lock();
        if d.as_ref().is_some_and(|d| d.generation != generation) {
            return d.take().map(|d| d.value);
        }
        None
    }

    /// The streaming hook attached by the offload layer (an `offload::Streamer`), if any.
    pub(crate) fn stream_hook(&self) -> Option<StreamHook> {
        self.stream_hook.read().clone()
    }

    /// Attaches or detaches the streaming hook. The one replaced is dropped after the lock is
    /// released (a streamer dropping its prefetches may wait for their copies).
    pub(crate) fn set_stream_hook(&self, hook: Option<StreamHook>) {
        let old = std::mem::replace(&mut *self.stream_hook.write(), hook);
        drop(old);
    }

    /// The manual-cast cache hook attached by the memory manager (an `ops::CastCache`), if any.
    pub(crate) fn cast_hook(&self) -> Option<StreamHook> {
        self.cast_hook.read().clone()
    }

    /// Attaches or detaches the manual-cast cache hook; returns the one it replaced.
    pub(crate) fn set_cast_hook(&self, hook: Option<StreamHook>) -> Option<StreamHook> {
        std::mem::replace(&mut *self.cast_hook.write(), hook)
    }

    /// A process-unique id.
    pub fn id(&self) -> u64 {
        self.id
    }
    /// The model's name (used in logs and errors).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Total size of the clean weights in their storage dtypes.
    pub fn model_size(&self) -> ByteSize {
        self.total
    }
    /// Total number of elements over all weights.
    pub fn numel(&self) -> u64 {
        self.numel
    }
    /// Block bytes and element count of the quantized weights (part of
    /// [`Model::model_size`] and [`Model::numel`]).
    pub fn quantized_size(&self) -> (ByteSize, u64) {
        self.quantized
    }
    /// The metadata of the GGUF file the model was read from (`None` for other models): model
    /// configs come from it (`llama.block_count`, ...).
    pub fn gguf_metadata(&self) -> Option<&GgufMetadata> {
        self.metadata.as_deref()
    }
    /// The stacked-expert tensor `name` of a GGUF model (`blk.0.ffn_gate_exps.weight`): not a
    /// slot itself, its experts are (`blk.0.ffn_gate_exps.3.weight`, ...). `None` for any other
    /// name.
    pub fn stack(&self, name: &str) -> Option<&Stack> {
        self.stacks.get(name)
    }
    /// Every stacked-expert tensor of a GGUF model, by name (no order).
    pub fn stacks(&self) -> impl Iterator<Item = (&str, &Stack)> {
        self.stacks.iter().map(|(k, v)| (k.as_str(), v))
    }
    /// Number of weights.
    pub fn len(&self) -> usize {
        self.slots.len()
    }
    /// Whether the model has no weights.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
    /// All slots, in file order.
    pub fn slots(&self) -> &[Slot] {
        &self.slots
    }
    /// The slot index of `key`.
    pub fn index_of(&self, key: &str) -> Option<usize> {
        self.index.get(key).copied()
    }

    /// How many times weight `key` was fetched for compute so far (every use through the
    /// manager's paths, resident or streamed), or `None` when the model has no such weight. What
    /// residency by use orders weights by; for a mixture of experts, how often each expert was
    /// routed to.
    pub fn uses(&self, key: &str) -> Option<u32> {
        self.index_of(key).map(|i| self.usage().of(i).count)
    }
    /// The slot named `key`, or an error naming model and key.
    pub fn slot(&self, key: &str) -> Result<&Slot> {
        self.index_of(key)
            .map(|i| &self.slots[i])
            .ok_or_else(|| Error::UnknownWeight {
                model: self.name.clone(),
                key: key.to_string(),
            })
    }
    /// Weight keys in file order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.slots.iter().map(|s| s.name.as_str())
    }
    /// Tensors in the file that are not float weights (integer buffers such as position ids),
    /// which were not loaded.
    pub fn skipped_tensors(&self) -> &[String] {
        &self.skipped
    }
    /// The clean tensor of `key` on the host (see [`Slot::clean`]).
    pub fn clean(&self, key: &str) -> Result<Tensor> {
        self.slot(key)?.clean()
    }

    /// Bytes of resident copies on `device`.
    pub fn resident_bytes(&self, device: DeviceId) -> ByteSize {
        self.state.read().bytes_on(device)
    }
    /// A number that changes whenever any of the model's resident copies changes.
    pub fn residency_generation(&self) -> u64 {
        self.state.read().generation()
    }
    /// Bytes of resident copies on any device.
    pub fn resident_bytes_total(&self) -> ByteSize {
        self.state.read().bytes_total()
    }
    /// Where weight `index` lives now.
    pub fn residency_of(&self, index: usize) -> Option<SlotResidency> {
        self.state.read().slots().get(index).cloned()
    }

    pub(crate) fn state(&self) -> RwLockReadGuard<'_, Residency> {
        self.state.read()
    }
    pub(crate) fn state_mut(&self) -> StateMut<'_> {
        StateMut(Some(self.state.write()))
    }

    /// Records that weight `index` was fetched by a forward. The first forward's order is kept;
    /// a weight seen again marks the order complete (the next forward has begun).
    pub fn record_use(&self, index: usize) {
        self.usage.record(index);
        // Free once the order is complete (after the second forward's first fetch): no lock.
        if self.order_complete.load(Ordering::Acquire) {
            return;
        }
        let mut fo = self.forward_order.lock();
        if fo.complete || index >= fo.seen.len() {
            return;
        }
        if fo.seen[index] {
            fo.complete = true;
            self.order_complete.store(true, Ordering::Release);
            return;
        }
        fo.seen[index] = true;
        fo.order.push(index);
    }

    /// Weight `index`'s fetch for a forward returned: the time until the next weight's use is
    /// its compute ([`Model::compute_ns`]).
    pub fn note_fetched(&self, index: usize) {
        self.usage.returned(index);
    }

    /// A quantized matmul of this model ran on `rows` input rows (a decode step's 1, a
    /// prefill's prompt length): what a miss run on the host would cost is priced at it.
    pub fn note_matmul_rows(&self, rows: usize) {
        self.usage.note_rows(rows);
    }

    /// The input rows of this model's last quantized matmul (`None` before one ran).
    pub fn matmul_rows(&self) -> Option<usize> {
        self.usage.rows()
    }

    /// Weight `index`'s compute per use as the host saw it — from the return of its fetch to
    /// the next weight's use, an exponential average (weight 1/4) — in nanoseconds; `None`
    /// before a forward measured it. What [`crate::costs::predict_step`] is given.
    pub fn compute_ns(&self, index: usize) -> Option<u64> {
        self.usage.compute_ns(index)
    }

    /// Starts the compute per use of the weights named in `figures` (nanoseconds, as an earlier
    /// run measured them: [`crate::costs::CostModel::compute_of`]), only while this model has
    /// measured nothing at all. How many were set.
    pub fn seed_compute(&self, figures: &std::collections::HashMap<String, u64>) -> usize {
        if (0..self.len()).any(|i| self.compute_ns(i).is_some()) {
            return 0;
        }
        let mut set = 0;
        for (i, slot) in self.slots().iter().enumerate() {
            if let Some(&ns) = figures.get(slot.name()) {
                self.usage.seed_compute(i, ns);
                set += 1;
            }
        }
        set
    }

    /// Marks the recorded forward order complete (called at the end of a forward).
    pub fn finish_forward(&self) {
        let mut fo = self.forward_order.lock();
        if !fo.order.is_empty() {
            fo.complete = true;
            self.order_complete.store(true, Ordering::Release);
        }
    }

    /// The order in which weights were first used in a forward (slot indices), and whether the
    /// recording is complete.
    pub fn forward_order(&self) -> (Vec<usize>, bool) {
        let fo = self.forward_order.lock();
        (fo.order.clone(), fo.complete)
    }

    /// The weights of the last forward in use order (`None` before a forward completed): the
    /// successor chain walked from the forward's first weight — each weight's successor is the
    /// one that followed it the last time it was used, so the walk follows the last forward —
    /// until it comes back to a weight already walked (the next forward's start; a weight used
    /// twice in a forward is walked once) or reaches one last used before the forward began. A mixture of experts' decode step walks the experts
    /// it routed, not the prompt's that the first-use order holds.
    pub fn last_forward_order(&self) -> Option<Vec<usize>> {
        let start = {
            let fo = self.forward_order.lock();
            if !fo.complete {
                return None;
            }
            *fo.order.first()?
        };
        let mut walked = vec![false; self.len()];
        let mut order = vec![start];
        walked[start] = true;
        let mut at = start;
        // The last forward began with the start's last use: a weight used before that (the
        // last forward's last weight's successor is from an older one) is not of it.
        let began = self.usage.of(start).age;
        while let Some(next) = self.usage.successor(at) {
            if walked.get(next).is_none_or(|&w| w) || self.usage.of(next).age > began {
                break;
            }
            walked[next] = true;
            order.push(next);
            at = next;
        }
        Some(order)
    }

    /// How many times a patched weight of this model was built (a patch chain applied to a clean
    /// weight), by any patcher: streamed LoRA'd weights count once per fetch, resident ones once
    /// per residency.
    pub fn patched_weights_built(&self) -> u64 {
        self.usage.patched()
    }

    /// How the model's weights were used (residency by use decides from it).
    pub(crate) fn usage(&self) -> &usage::Usage {
        &self.usage
    }

    /// The recorded forward order as weight keys.
    pub fn forward_order_keys(&self) -> Vec<String> {
        self.forward_order()
            .0
            .iter()
            .map(|&i| self.slots[i].name.clone())
            .collect()
    }

    /// A checksum of every clean weight's bytes (for tests of invariant I1).
    pub fn clean_checksum(&self) -> Result<u64> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for s in &self.slots {
            s.name.hash(&mut h);
            let bytes = tensor_bytes(&s.clean()?)?;
            bytes.hash(&mut h);
        }
        Ok(h.finish())
    }
}
