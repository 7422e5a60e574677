//! The `[out, in]` of the linear module a patch was trained for, read off the patch's own
//! tensors.
//!
//! A LoRA for one projection of a fused weight patches a run of its rows, and where that run
//! starts can depend on the model's sizes: a Flux single block's MLP input starts after q, k and v
//! (`3 × hidden` rows into `linear1`), and whether SD3's context modulation swaps its halves
//! depends on whether it has two chunks of the hidden size or six. With the model's shapes
//! ([`super::load_for`]) those sizes are the model's own. With its keys alone ([`super::load`],
//! which `lora_merge` and most callers use) they are read here instead: the module's input width
//! *is* the hidden size for every module that needs it (`linear1` and `adaLN_modulation.1` are
//! `Linear(hidden, …)`), and its output rows are the rows it patches. These are the patch's own
//! dimensions, not a guess; the patcher still checks every offset against the weight when the
//! patches are added.
//!
//! Read for the kinds that add a delta of the module's shape: LoRA (and LoCon with a Tucker
//! core), LoHa, LoKr (factorised or whole, with or without a Tucker core) and a diff. GLoRA, OFT,
//! BOFT and a set are not read (`None`): placing them on part of a fused weight whose sizes
//! depend on the model needs [`super::load_for`]. O(1): dimensions only.

use crate::patcher::adapters::Patch;

/// `(out, in)` of the linear module `patch` was trained for, when its kind says it (see the
/// module docs).
pub(super) fn module_shape(patch: &Patch) -> Option<(usize, usize)> {
    match patch {
        Patch::Lora(l) => Some((dim(&l.up, 0)?, dim(&l.down, 1)?)),
        Patch::LoHa(h) => factor(&h.w1a, &h.w1b, h.t1.is_some()),
        Patch::LoKr(k) => {
            let w1 = match (&k.w1, &k.w1a, &k.w1b) {
                (Some(w), _, _) => (dim(w, 0)?, dim(w, 1)?),
                (None, Some(a), Some(b)) => factor(a, b, false)?,
                _ => return None,
            };
            let w2 = match (&k.w2, &k.w2a, &k.w2b) {
                (Some(w), _, _) => (dim(w, 0)?, dim(w, 1)?),
                (None, Some(a), Some(b)) => factor(a, b, k.t2.is_some())?,
                _ => return None,
            };
            Some((w1.0.checked_mul(w2.0)?, w1.1.checked_mul(w2.1)?))
        }
        Patch::Diff { diff, .. } => Some((dim(diff, 0)?, dim(diff, 1)?)),
        Patch::GLora(_) | Patch::Oft(_) | Patch::Boft(_) | Patch::Set(_) => None,
    }
}

/// `(out, in)` of the product `a · b` (`a [out, r]`, `b [r, in]`), or of the Tucker product,
/// whose left factor is stored transposed (`a [r, out]`).
fn factor(
    a: &candle_core::Tensor,
    b: &candle_core::Tensor,
    tucker: bool,
) -> Option<(usize, usize)> {
    let out = if tucker { dim(a, 1)? } else { dim(a, 0)? };
    Some((out, dim(b, 1)?))
}

fn dim(t: &candle_core::Tensor, i: usize) -> Option<usize> {
    t.dims().get(i).copied()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::patcher::adapters::{LoHa, LoKr, Lora};
    use candle_core::{DType, Device, Tensor};

    fn zeros(shape: &[usize]) -> Tensor {
        Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn each_delta_kind_gives_the_out_and_in_of_its_module() {
        let lora = Patch::Lora(Lora::new(zeros(&[12, 2]), zeros(&[2, 3])));
        assert_eq!(module_shape(&lora), Some((12, 3)));
        let loha = |t1: Option<Tensor>, w1a: &[usize]| {
            Patch::LoHa(LoHa {
                w1a: zeros(w1a),
                w1b: zeros(&[2, 3]),
                w2a: zeros(w1a),
                w2b: zeros(&[2, 3]),
                t1: t1.clone(),
                t2: t1,
                alpha: None,
                dora_scale: None,
            })
        };
        assert_eq!(module_shape(&loha(None, &[12, 2])), Some((12, 3)));
        assert_eq!(
            module_shape(&loha(Some(zeros(&[2, 2, 1, 1])), &[2, 12])),
            Some((12, 3)),
            "a Tucker LoHa stores its left factor transposed"
        );
        let lokr = Patch::LoKr(LoKr {
            w1: Some(zeros(&[4, 1])),
            w2a: Some(zeros(&[3, 2])),
            w2b: Some(zeros(&[2, 3])),
            ..LoKr::default()
        });
        assert_eq!(module_shape(&lokr), Some((12, 3)));
        let diff = Patch::Diff {
            diff: zeros(&[12, 3]),
            pad: false,
        };
        assert_eq!(module_shape(&diff), Some((12, 3)));
        assert_eq!(module_shape(&Patch::Set(zeros(&[12, 3]))), None);
    }
}
