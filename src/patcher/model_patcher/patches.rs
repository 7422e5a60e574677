//! A patcher's patches: adding and validating them, and the fingerprints that say which
//! resident copy is current for them.

use super::*;

impl ModelPatcher {
    /// The patch set.
    pub fn patches(&self) -> &PatchSet {
        &self.patches
    }

    /// Adds patches. Keys not in the model are ignored (not returned); every patch for a known key
    /// is validated against the weight's shape (after the patches already there) before anything is
    /// added, and one bad patch rejects the whole call with an error naming key and shapes (I4,
    /// docs/ARCHITECTURE.md §4.4). `strength_patch` scales each patch; `strength_model` scales the
    /// weight accumulated so far. Returns the keys that matched, in input order.
    pub fn add_patches<K, I>(
        &mut self,
        patches: I,
        strength_patch: f32,
        strength_model: f32,
    ) -> Result<Vec<String>>
    where
        K: Into<PatchKey>,
        I: IntoIterator<Item = (K, Patch)>,
    {
        let entries = patches.into_iter().map(|(k, p)| {
            let k: PatchKey = k.into();
            let mut e = PatchEntry::new(p).with_strengths(strength_patch, strength_model);
            e.offset = k.offset;
            (k.key, e)
        });
        self.add_patch_entries(entries)
    }

    /// Adds ready-made entries (each with its own strengths and offset); same rules as
    /// [`ModelPatcher::add_patches`].
    pub fn add_patch_entries<I>(&mut self, entries: I) -> Result<Vec<String>>
    where
        I: IntoIterator<Item = (String, PatchEntry)>,
    {
        let mut staged: Vec<(String, PatchEntry)> = Vec::new();
        for (key, entry) in entries {
            if self.model.index_of(&key).is_some() {
                staged.push((key, entry));
            }
        }
        // Validate each key's full chain (existing + new, in order) and every new entry's values
        // before adding anything.
        let mut by_key: HashMap<&str, Vec<PatchEntry>> = HashMap::new();
        for (key, entry) in &staged {
            by_key.entry(key.as_str()).or_default().push(entry.clone());
        }
        for (key, entry) in &staged {
            adapters::check_values(key, entry)?;
        }
        for (key, new) in &by_key {
            let slot = self.model.slot(key)?;
            let mut chain: Vec<PatchEntry> = self
                .patches
                .get(key)
                .iter()
                .map(|e| e.entry.clone())
                .collect();
            chain.extend(new.iter().cloned());
            adapters::patched_shape(key, slot.shape(), &chain)?;
        }
        self.fingerprints = std::sync::OnceLock::new();
        let set = Arc::make_mut(&mut self.patches);
        set.version = NEXT_PATCH_ID.fetch_add(1, Ordering::Relaxed);
        let mut matched = Vec::with_capacity(staged.len());
        for (key, entry) in staged {
            let list = set.map.entry(key.clone()).or_default();
            Arc::make_mut(list).push(SetEntry {
                id: NEXT_PATCH_ID.fetch_add(1, Ordering::Relaxed),
                entry,
            });
            matched.push(key);
        }
        Ok(matched)
    }

    /// Checks that every patch chain still fits its weight and that every patched fp8 weight has
    /// a usable scale: what a load needs before it evicts anything. O(patched keys).
    ///
    /// # Errors
    /// [`Error::PatchShape`] / [`Error::BadPatch`] naming the key.
    pub fn validate(&self) -> Result<()> {
        for key in self.patches.keys() {
            let index = self.index_of(key)?;
            let slot = &self.model.slots()[index];
            let chain: Vec<PatchEntry> = self
                .patches
                .get(key)
                .iter()
                .map(|e| e.entry.clone())
                .collect();
            adapters::patched_shape(key, slot.shape(), &chain)?;
            self.weight_scale(index)?;
        }
        Ok(())
    }

    /// What a resident copy's fingerprint depends on, for the whole model at once: the patch
    /// set's version, the compute dtype, the DoRA mode and the load device. Two patchers of one
    /// model with equal signatures want exactly the same resident copies. O(1).
    pub(crate) fn residency_signature(&self) -> ResidencySignature {
        (
            self.patches.version,
            self.options.compute_dtype,
            self.options.dora,
            self.options.requantize_patched,
            self.load_device(),
            self.placement_id(),
        )
    }

    /// Re-quantizes patched quantized weights to their own format instead of using them dense
    /// ([`PatcherOptions::requantize_patched`]).
    pub fn with_requantized_patches(mut self, on: bool) -> Self {
        self.options.requantize_patched = on;
        self.fingerprints = std::sync::OnceLock::new();
        self
    }

    /// Whether weight `index` is quantized, patched, and re-quantized after patching: its
    /// resident and streamed copies are then the re-quantized blocks.
    pub(crate) fn requantizes(&self, index: usize) -> bool {
        let slot = &self.model.slots()[index];
        self.options.requantize_patched
            && slot.quantized().is_some()
            && !self.patches.get(slot.name()).is_empty()
    }

    /// Removes every patch (the clone then computes the clean model).
    pub fn clear_patches(&mut self) {
        self.patches = Arc::new(PatchSet::default());
        self.fingerprints = std::sync::OnceLock::new();
    }

    /// The dtype weight `index` is kept in when resident (the compute dtype, else storage). A
    /// quantized weight stays in its blocks when resident; this is the dtype its dequantized
    /// (and patched) value is used in.
    pub fn resident_dtype(&self, index: usize) -> Dtype {
        self.options
            .compute_dtype
            .unwrap_or_else(|| self.model.slots()[index].dtype())
    }

    /// Bytes weight `index` takes when resident (a quantized weight: its block bytes).
    pub fn resident_size(&self, index: usize) -> ByteSize {
        let slot = &self.model.slots()[index];
        if slot.quantized().is_some() {
            return slot.bytes();
        }
        slot.bytes_in(self.resident_dtype(index))
    }

    /// Every weight's fingerprint, by index (shared, computed once per patch set).
    pub(crate) fn fingerprints(&self) -> Arc<[Fingerprint]> {
        Arc::clone(self.fingerprints.get_or_init(|| {
            (0..self.model.len())
                .map(|i| self.compute_fingerprint(i))
                .collect()
        }))
    }

    /// The fingerprint of weight `index` under this patcher: its patch list, DoRA mode and
    /// resident dtype. A quantized weight's resident copy is its clean blocks whatever the
    /// patches (they apply to its dequantized value at use), so its fingerprint is its format's
    /// alone: switching between a model and its LoRA clone moves none of its quantized weights.
    pub fn fingerprint(&self, index: usize) -> Fingerprint {
        if self.patches.is_empty() {
            // A table lookup already; no vector for a model without patches.
            return self.compute_fingerprint(index);
        }
        let all = self.fingerprints.get_or_init(|| {
            (0..self.model.len())
                .map(|i| self.compute_fingerprint(i))
                .collect()
        });
        all[index]
    }

    /// [`ModelPatcher::fingerprint`], computed.
    pub(super) fn compute_fingerprint(&self, index: usize) -> Fingerprint {
        let slot = &self.model.slots()[index];
        if let Some(ggml) = slot.quantized() {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            ggml.hash(&mut h);
            if self.requantizes(index) {
                self.patch_fingerprint(index, Dtype::F32).hash(&mut h);
            }
            return h.finish();
        }
        self.patch_fingerprint(index, self.resident_dtype(index))
    }

    /// The fingerprint of weight `index`'s patch list, DoRA mode and `dtype`: what a dense copy
    /// of the patched weight in `dtype` is built from (for a quantized weight, its dequantized,
    /// patched value, which the manual-cast cache keeps under this key).
    pub(crate) fn patch_fingerprint(&self, index: usize, dtype: Dtype) -> Fingerprint {
        let slot = &self.model.slots()[index];
        // Unpatched weights (every weight of a model without patches: no key lookup) take the
        // same value from a table; loads ask for each weight's fingerprint several times.
        let entries = if self.patches.is_empty() {
            &[]
        } else {
            self.patches.get(slot.name())
        };
        if entries.is_empty() {
            return clean_fingerprint(dtype);
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        dtype.hash(&mut h);
        (self.options.dora == DoraNorm::ComfyUi).hash(&mut h);
        for e in entries {
            e.id.hash(&mut h);
            e.entry.strength_patch.to_bits().hash(&mut h);
            e.entry.strength_model.to_bits().hash(&mut h);
            e.entry.offset.map(|o| (o.dim, o.start, o.len)).hash(&mut h);
        }
        h.finish()
    }

    /// The slot index of `key`, or an error naming the model and the key.
    pub(super) fn index_of(&self, key: &str) -> Result<usize> {
        self.model
            .index_of(key)
            .ok_or_else(|| Error::UnknownWeight {
                model: self.model.name().to_string(),
                key: key.to_string(),
            })
    }
}
