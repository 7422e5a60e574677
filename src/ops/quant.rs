//! Writing weights in the per-tensor quantized form the ops layers read (see the module docs of
//! [`crate::ops`] for the convention: fp8 `<layer>.weight` + f32 scalar `<layer>.weight_scale`).

use candle_core::Tensor;

use crate::error::{Error, Result, TensorContext};
use crate::float::{self, Dtype, Rounding};
use crate::patcher::WEIGHT_SCALE_SUFFIX;

/// Quantizes an f32 weight to `format` (fp8 E4M3FN or E5M2) with one per-tensor scale:
/// `scale = max|w| / max_finite(format)` (1 for an all-zero weight), codes =
/// `round(w / scale)` with seeded stochastic rounding keyed by `key` (the weight's name).
/// Returns the codes (in `format`'s storage dtype) and the scale as a one-element f32 tensor.
///
/// # Errors
/// [`Error::UnsupportedDtype`] when `format` is not fp8 or `w` is not f32.
pub fn quantize_per_tensor(w: &Tensor, format: Dtype, key: &str) -> Result<(Tensor, Tensor)> {
    let max_finite = match format {
        Dtype::F8E4M3FN => 448.0f32,
        Dtype::F8E5M2 => 57344.0f32,
        other => {
            return Err(Error::UnsupportedDtype {
                dtype: other.to_string(),
                what: format!("per-tensor quantization of `{key}` (fp8 formats only)"),
            })
        }
    };
    let ctx = || format!("quantizing `{key}`");
    crate::lock::check_wait("a read-back of a weight's absolute maximum (candle `to_scalar`)");
    let amax = w
        .abs()
        .and_then(|a| a.flatten_all())
        .and_then(|a| a.max(0))
        .and_then(|a| a.to_scalar::<f32>())
        .ctx(ctx)?;
    let scale = if amax > 0.0 && amax.is_finite() {
        amax / max_finite
    } else {
        1.0
    };
    let scaled = (w / f64::from(scale)).ctx(ctx)?;
    let codes = float::from_f32(&scaled, format, Rounding::stochastic_for(key))?;
    let scale = Tensor::new(&[scale], w.device()).ctx(ctx)?;
    Ok((codes, scale))
}

/// The key of the scale stored next to weight `weight_key` (`x.weight` → `x.weight_scale`), or
/// `None` when the key does not end in `.weight`.
pub fn scale_key(weight_key: &str) -> Option<String> {
    weight_key
        .strip_suffix(".weight")
        .map(|p| format!("{p}{WEIGHT_SCALE_SUFFIX}"))
}
