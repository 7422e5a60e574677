//! What a source hands to a model's code as the code's own tensor — a parameter
//! `nn::VarBuilder::get` returns, a managed quantized weight `quantized::QTensor::dequantize`
//! returns — counted in the held-outside table ([`crate::weights::outside`]) under the form that
//! tells two hand-outs of one weight apart.

use std::sync::{Arc, Weak};

use candle_core::{DType, Device, DeviceLocation, Tensor};

use crate::patcher::ModelPatcher;
use crate::weights::outside::{self, HandOut, Origin};

use super::{OpsMode, OpsSource};

/// The call that hands a tensor out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Via {
    /// `nn::VarBuilder::get` in a layer mode.
    Get(OpsMode),
    /// A dequantize of a managed quantized weight.
    Dequantize,
}

/// What makes two hand-outs of one weight the same bits in the same place: the patcher the
/// source fetched through (its patches and wrappers), the dtype and device asked for, and the
/// call.
struct Form {
    /// Compared by allocation; the weak handle keeps the address from being reused.
    patcher: Weak<ModelPatcher>,
    dtype: DType,
    location: DeviceLocation,
    via: Via,
}

impl PartialEq for Form {
    fn eq(&self, other: &Form) -> bool {
        self.patcher.ptr_eq(&other.patcher)
            && self.dtype == other.dtype
            && self.location == other.location
            && self.via == other.via
    }
}

impl OpsSource {
    /// Weight `key` handed to the model's code in `dtype` on `device` by `via`: the copy kept
    /// for it when this weight was read twice before in this form from this source, else
    /// `read()`'s tensor; counted outside the ledger until a layer constructor adopts it, this
    /// source (every handle on it) is dropped, or the model is.
    pub(crate) fn hand_out(
        &self,
        key: &str,
        dtype: DType,
        device: &Device,
        via: Via,
        read: impl FnOnce() -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let patcher = self.patcher();
        let form = Form {
            patcher: Arc::downgrade(&patcher),
            dtype,
            location: device.location(),
            via,
        };
        let h = HandOut {
            model_id: patcher.model().id(),
            load_device: patcher.load_device(),
            key,
            origin: Origin::new(Arc::downgrade(&self.patcher)),
            form: Box::new(form),
        };
        outside::hand_out(h, read)
    }
}
