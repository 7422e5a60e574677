//! [`OpsSource::load`]: a model's layers switched to a patcher and that patcher loaded, in one
//! call. The method is the loader's, not `ops`'s: a layer never triggers eviction, and `ops`
//! sits below the manager (docs/ARCHITECTURE.md §2).

use crate::error::Result;
use crate::ops::OpsSource;
use crate::patcher::ModelPatcher;

use super::{LoadOptions, LoadReport, MemoryManager};

impl OpsSource {
    /// Switches every layer to `patcher` and loads it with `manager`, in one call: what is loaded
    /// is what computes (the LoRA clone a node made, say). On error the layers keep the patcher
    /// they had and nothing loaded is changed.
    ///
    /// # Errors
    /// [`Error::WrongModel`](crate::Error::WrongModel) as [`OpsSource::set_patcher`]; whatever
    /// [`MemoryManager::load_models_gpu`] refuses.
    pub fn load(
        &self,
        manager: &MemoryManager,
        patcher: &ModelPatcher,
        options: LoadOptions,
    ) -> Result<LoadReport> {
        let before = self.patcher();
        self.set_patcher(patcher)?;
        manager
            .load_models_gpu(&[patcher], options)
            .inspect_err(|_| self.put_back(before))
    }
}
