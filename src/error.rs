//! Typed errors.
//!
//! Every fallible call returns [`Error`]. Variants fall in three groups, and
//! [`Error::is_retryable`] tells them apart:
//! - *transient*: [`Error::OutOfMemory`] — the device is short right now; evicting other models or
//!   waiting for in-flight work to finish may help;
//! - *never fits*: [`Error::BudgetExceeded`], [`Error::AttentionTooLarge`] — no eviction helps,
//!   change the budget, the dtype or the input size;
//! - *bad input*: configuration, sizes, files, patches, shapes — fix the input.
//!
//! Messages name the model, the weight key and the sizes involved, so a user can act on them
//! without a debugger. A failed call never changes what was already loaded (I4,
//! docs/ARCHITECTURE.md §4.4).

use std::path::PathBuf;

use crate::size::ByteSize;

/// Result alias used across the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in residency.
///
/// Raised inside a candle forward (a layer of [`crate::nn`] or [`crate::ops`] fetching its
/// weight), it travels as a `candle_core::Error` and keeps its type: `Error::from` (or `?` in a
/// function returning this `Result`) gives it back, [`Error::in_candle`] finds it by reference,
/// so an [`Error::OutOfMemory`] met in a forward is still retryable. Its `Debug` form is its
/// message (candle prints the errors it wraps with `Debug`).
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A size string could not be parsed.
    #[error("invalid size `{input}`: {reason} (examples: 512MiB, 4GiB, 1.5GB, 1073741824)")]
    InvalidSize {
        /// What the user wrote.
        input: String,
        /// Why it was rejected.
        reason: String,
    },

    /// A command-line flag or environment variable is not known.
    #[error("unknown flag `{flag}`{}", suggestion.as_ref().map(|s| format!(" (did you mean `{s}`?)")).unwrap_or_default())]
    UnknownFlag {
        /// The flag as given.
        flag: String,
        /// The closest known flag, if any.
        suggestion: Option<String>,
    },

    /// A flag was given a value it cannot take, or lacks one it needs.
    #[error("flag `{flag}`: {reason}")]
    InvalidFlag {
        /// The flag.
        flag: String,
        /// What was wrong.
        reason: String,
    },

    /// Layers built on one model were given a patcher of another
    /// ([`crate::ops::OpsSource::set_patcher`]); nothing was switched.
    #[error("the layers were built on model `{layers}` but were given a patcher of model `{given}`; set_patcher takes a clone of `{layers}` (`patcher.clone()`, then add patches)")]
    WrongModel {
        /// The model the layers were built on.
        layers: String,
        /// The model of the patcher given.
        given: String,
    },

    /// A device map rule ([`crate::DeviceMap::parse`], [`crate::DeviceMap::regex`]) cannot be
    /// used. Nothing was mapped.
    #[error("device map rule `{rule}`: {reason}")]
    BadDeviceMap {
        /// The rule as given.
        rule: String,
        /// What is wrong with it.
        reason: String,
    },

    /// Two flags that exclude each other were both given.
    #[error("flags `{first}` and `{second}` cannot be used together")]
    ConflictingFlags {
        /// The first flag seen.
        first: String,
        /// The flag that conflicts with it.
        second: String,
    },

    /// The device does not have this much free memory right now. Evicting other models, or
    /// waiting for in-flight transfers, may make the same call succeed.
    ///
    /// Also what a CUDA out-of-memory reported by candle becomes (see [`Error::tensor`]); the
    /// sizes are then unknown and both zero, and `model` says what was running.
    #[error("{}", out_of_memory_message(model, device, *required, *available))]
    OutOfMemory {
        /// The model being loaded, or what was running when candle ran out of device memory.
        model: String,
        /// The device.
        device: String,
        /// Bytes the call needed.
        required: ByteSize,
        /// Bytes that were free.
        available: ByteSize,
    },

    /// The request can never fit this device's budget, whatever is evicted.
    #[error(
        "{} needs {required} on {device} but its budget is {budget}; it can never fit ({})",
        quoted(model),
        budget_hint(model, device)
    )]
    BudgetExceeded {
        /// The model being loaded.
        model: String,
        /// The device.
        device: String,
        /// Bytes the call needed.
        required: ByteSize,
        /// The device's total budget.
        budget: ByteSize,
    },

    /// A model has no weight with this name.
    #[error("model `{model}` has no weight `{key}`")]
    UnknownWeight {
        /// The model.
        model: String,
        /// The missing key.
        key: String,
    },

    /// A weight of a model being read or built holds a value it cannot work with (an fp8 weight's
    /// per-tensor scale that is not one finite, non-zero number). Nothing was built.
    #[error("model `{model}`, weight `{key}`: {reason}")]
    BadWeight {
        /// The model.
        model: String,
        /// The weight key.
        key: String,
        /// What was wrong.
        reason: String,
    },

    /// A patch does not fit the weight it targets. Nothing was added.
    #[error("patch for `{key}` does not fit: weight shape {weight_shape:?}, patch shape {patch_shape:?}: {reason}")]
    PatchShape {
        /// The weight key.
        key: String,
        /// The (possibly narrowed) weight shape.
        weight_shape: Vec<usize>,
        /// The shape the patch produces.
        patch_shape: Vec<usize>,
        /// What was wrong.
        reason: String,
    },

    /// A patch is malformed in a way unrelated to the weight's shape (missing parts, bad rank).
    #[error("malformed patch for `{key}`: {reason}")]
    BadPatch {
        /// The weight key.
        key: String,
        /// What was wrong.
        reason: String,
    },

    /// The routing handed to a mixture-of-experts matmul (`residency::nn::moe`) does not fit
    /// its input or its experts.
    #[error("mixture-of-experts routing for `{what}`: {reason}")]
    BadRouting {
        /// The expert weights (a key, or "owned experts").
        what: String,
        /// What was wrong.
        reason: String,
    },

    /// A file could not be read, parsed or written.
    #[error("{}: {reason}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong, including the tensor name where one is involved.
        reason: String,
    },

    /// A dtype that this operation does not handle.
    #[error("unsupported dtype {dtype} for {what}")]
    UnsupportedDtype {
        /// The dtype's name.
        dtype: String,
        /// What was attempted.
        what: String,
    },

    /// Two tensors, or a tensor and what it should be, disagree in shape.
    #[error("shape mismatch in {what}: expected {expected:?}, got {got:?}")]
    ShapeMismatch {
        /// Where.
        what: String,
        /// The expected shape.
        expected: Vec<usize>,
        /// The shape seen.
        got: Vec<usize>,
    },

    /// Attention cannot run within the given memory with any chunking.
    #[error("attention needs more memory than available: {required} for the smallest split, {available} free; the largest sequence that fits is about {max_tokens} tokens")]
    AttentionTooLarge {
        /// Bytes the smallest split needs.
        required: ByteSize,
        /// Bytes free.
        available: ByteSize,
        /// The largest query/key length that would fit.
        max_tokens: usize,
    },

    /// A driver or device call failed.
    #[error("device {device}: {reason}")]
    Device {
        /// The device.
        device: String,
        /// The driver's message.
        reason: String,
    },

    /// A load failed mid-way (`source`) and was rolled back, but some resident copies it had
    /// dropped could not be rebuilt (memory ran out again, or no patcher that built them is
    /// left); those weights now stream until their model is loaded again. Everything else is as
    /// it was before the call.
    #[error("{source}; rolled back, but {} resident copies could not be restored: {}", not_restored.len(), not_restored.join(", "))]
    RollbackIncomplete {
        /// Why the load failed.
        #[source]
        source: Box<Error>,
        /// Each copy not restored: model, weight key, size and device.
        not_restored: Vec<String>,
    },

    /// A managed model's module was asked for while its weights are not all resident and current
    /// for that patcher: load it first (`load_models_gpu`).
    #[error("model `{model}` is not loaded: every weight must be resident for its module to be built; load it with load_models_gpu first")]
    NotLoaded {
        /// The model.
        model: String,
    },

    /// The process-wide manager exists already ([`crate::init_global`] after the first
    /// [`crate::global`] call, or twice); the configuration given was not applied.
    #[error("the global memory manager was already built; call init_global once, before anything uses residency::global()")]
    GlobalAlreadyInitialized,

    /// An error from a candle tensor operation, with what we were doing.
    #[error("{context}: {source}")]
    Tensor {
        /// What we were doing.
        context: String,
        /// candle's error.
        #[source]
        source: candle_core::Error,
    },
}

/// `name` in backticks, unless it already quotes what it names (``"`m` weight `k`"``).
fn quoted(name: &str) -> String {
    if name.contains('`') {
        name.to_string()
    } else {
        format!("`{name}`")
    }
}

/// What would help a request that can never fit `device`'s budget.
fn budget_hint(model: &str, device: &str) -> &'static str {
    if model.starts_with("reservation") {
        "reserve less, or raise --vram-budget"
    } else if model.contains("weight `") && !device.starts_with("host") {
        "a weight is fetched whole, so partial loading does not help: raise --vram-budget, store it in a smaller dtype, or place it on the CPU with a device map"
    } else if device.starts_with("host") {
        "raise --ram-budget, or store the weight in a smaller dtype; a weight is read whole, so partial loading does not help"
    } else {
        "raise --vram-budget, allow partial loading, or use a smaller dtype"
    }
}

impl Error {
    /// Whether the same call may succeed after freeing memory or waiting: true only for
    /// [`Error::OutOfMemory`] (also when it caused an incomplete rollback).
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::OutOfMemory { .. } => true,
            Error::RollbackIncomplete { source, .. } => source.is_retryable(),
            _ => false,
        }
    }

    /// A failed CUDA driver call on GPU `ordinal` while doing `what`.
    pub fn driver(ordinal: usize, what: &str, e: cudarc::driver::DriverError) -> Self {
        Error::Device {
            device: format!("cuda:{ordinal}"),
            reason: format!("{what}: {e}"),
        }
    }

    /// Wraps a candle error with context. A CUDA out-of-memory (the driver's
    /// `CUDA_ERROR_OUT_OF_MEMORY`, or cuBLAS failing to allocate) becomes the retryable
    /// [`Error::OutOfMemory`], naming `context`; anything else is [`Error::Tensor`].
    ///
    /// A candle error that carries a residency error (one raised inside a forward) gives that
    /// error back, with its type.
    pub fn tensor(context: impl Into<String>, source: candle_core::Error) -> Self {
        let source = match Error::out_of_candle(source) {
            Ok(inner) => return inner,
            Err(source) => source,
        };
        let context = context.into();
        if is_cuda_out_of_memory(&source) {
            return Error::OutOfMemory {
                model: format!("{context} ({source})"),
                device: "cuda".into(),
                required: ByteSize::ZERO,
                available: ByteSize::ZERO,
            };
        }
        Error::Tensor { context, source }
    }
}

/// Whether candle's error is a CUDA device running out of memory. candle wraps the driver's and
/// cuBLAS's errors as text (`Error::Cuda(Box<dyn Error>)`, possibly inside context and backtrace
/// layers), so this reads the message for the status names cudarc prints.
fn is_cuda_out_of_memory(e: &candle_core::Error) -> bool {
    let text = e.to_string();
    text.contains("CUDA_ERROR_OUT_OF_MEMORY") || text.contains("CUBLAS_STATUS_ALLOC_FAILED")
}

fn out_of_memory_message(
    model: &str,
    device: &str,
    required: ByteSize,
    available: ByteSize,
) -> String {
    let hint = if model.starts_with("reservation") {
        "reserve less, or raise --vram-budget"
    } else {
        "free other models (MemoryManager::retry_on_oom does) or raise --vram-budget, then retry"
    };
    if required == ByteSize::ZERO && available == ByteSize::ZERO {
        format!("out of memory on {device} in {model} ({hint})")
    } else if model.contains('`') {
        format!("out of memory on {device} {model}: {required} required, {available} available ({hint})")
    } else {
        format!("out of memory on {device} loading `{model}`: {required} required, {available} available ({hint})")
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// The context a residency error carries inside candle's error.
const IN_CANDLE: &str = "raised by residency (residency::Error::from gives the typed error back)";

impl std::str::FromStr for ByteSize {
    type Err = Error;

    /// Parses `1073741824`, `512MiB`, `4GiB`, `1.5GB`, `100 KB`, `2G`. Binary suffixes (`KiB`,
    /// `MiB`, `GiB`, `TiB`, and the bare `K`, `M`, `G`, `T` as ComfyUI and most tools read them)
    /// are powers of 1024; decimal ones (`KB`, `MB`, `GB`, `TB`) powers of 1000. Case-insensitive.
    ///
    /// # Errors
    /// [`Error::InvalidSize`], naming the input and why. (Here rather than in `size.rs`, which
    /// parses, so that `size` names nothing of the crate and `error` may name `size`.)
    fn from_str(s: &str) -> Result<Self> {
        ByteSize::parse(s).map_err(|reason| Error::InvalidSize {
            input: s.to_string(),
            reason: reason.to_string(),
        })
    }
}

impl From<Error> for candle_core::Error {
    /// candle's error holding `e` itself (`WrappedContext`, downcastable), so that
    /// `residency::Error::from` on the way out gives `e` back with its type.
    fn from(e: Error) -> Self {
        candle_core::Error::WrappedContext {
            wrapped: Box::new(e),
            context: IN_CANDLE.to_string(),
        }
    }
}

impl From<candle_core::Error> for Error {
    /// The residency error inside `source` when there is one (raised in a forward and carried
    /// through candle), with its type; otherwise [`Error::tensor`].
    fn from(source: candle_core::Error) -> Self {
        Error::tensor("tensor operation", source)
    }
}

impl Error {
    /// The residency error a candle error carries, if any: one raised by a layer's fetch inside
    /// a forward and propagated through candle (under backtrace, context and path layers).
    pub fn in_candle(e: &candle_core::Error) -> Option<&Error> {
        match e {
            candle_core::Error::WrappedContext { wrapped, .. } => wrapped.downcast_ref::<Error>(),
            candle_core::Error::WithBacktrace { inner, .. }
            | candle_core::Error::Context { inner, .. }
            | candle_core::Error::WithPath { inner, .. } => Error::in_candle(inner),
            _ => None,
        }
    }

    /// Takes the residency error out of `e` (see [`Error::in_candle`]), or gives `e` back.
    fn out_of_candle(e: candle_core::Error) -> std::result::Result<Error, candle_core::Error> {
        if Error::in_candle(&e).is_none() {
            return Err(e);
        }
        match e {
            candle_core::Error::WrappedContext { wrapped, context } => {
                match wrapped.downcast::<Error>() {
                    Ok(inner) => Ok(*inner),
                    Err(wrapped) => Err(candle_core::Error::WrappedContext { wrapped, context }),
                }
            }
            candle_core::Error::WithBacktrace { inner, .. }
            | candle_core::Error::Context { inner, .. }
            | candle_core::Error::WithPath { inner, .. } => Error::out_of_candle(*inner),
            other => Err(other),
        }
    }

    /// An out-of-memory met while a forward fetched weight `key` of `model`, saying so (any
    /// other error is returned as it is).
    pub(crate) fn fetching(self, model: &str, key: &str) -> Error {
        match self {
            Error::OutOfMemory {
                model: what,
                device,
                required,
                available,
            } if !what.contains(" of model `") => Error::OutOfMemory {
                model: format!("fetching weight `{key}` of model `{model}` for a forward ({what})"),
                device,
                required,
                available,
            },
            other => other,
        }
    }
}

/// Adds context to candle results.
#[allow(dead_code)]
pub(crate) trait TensorContext<T> {
    /// Attaches `what` to a candle error.
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> TensorContext<T> for std::result::Result<T, candle_core::Error> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::tensor(what(), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_budget_error_quotes_once_and_names_the_flag_that_helps() {
        let host = Error::BudgetExceeded {
            model: "`all-MiniLM-L6-v2` weight `embeddings.word_embeddings.weight`".into(),
            device: "host (--ram-budget)".into(),
            required: ByteSize::mib(44),
            budget: ByteSize::mib(24),
        }
        .to_string();
        assert!(!host.contains("``"), "{host}");
        assert!(
            host.contains("raise --ram-budget") && !host.contains("--vram-budget"),
            "{host}"
        );
        assert!(!host.contains("allow partial loading"), "{host}");
        let device = Error::BudgetExceeded {
            model: "unet".into(),
            device: "cuda:0".into(),
            required: ByteSize::gib(9),
            budget: ByteSize::gib(8),
        }
        .to_string();
        assert!(device.starts_with("`unet` needs"), "{device}");
        assert!(
            device.contains("raise --vram-budget, allow partial loading"),
            "{device}"
        );
    }

    #[test]
    fn only_out_of_memory_is_retryable() {
        let oom = Error::OutOfMemory {
            model: "unet".into(),
            device: "cuda:0".into(),
            required: ByteSize::gib(2),
            available: ByteSize::gib(1),
        };
        let never = Error::BudgetExceeded {
            model: "unet".into(),
            device: "cpu".into(),
            required: ByteSize::gib(8),
            budget: ByteSize::gib(4),
        };
        assert!(oom.is_retryable());
        assert!(!never.is_retryable());
        let msg = never.to_string();
        assert!(
            msg.contains("unet") && msg.contains("8.00 GiB") && msg.contains("4.00 GiB"),
            "{msg}"
        );
        let msg = oom.to_string();
        assert!(
            msg.contains("2.00 GiB required") && msg.contains("loading `unet`"),
            "{msg}"
        );
    }

    /// The text candle gives a failed allocation on CUDA: cudarc's `DriverError` debug form
    /// inside candle's `Error::Cuda`, under a backtrace layer.
    #[derive(Debug)]
    struct DriverText(&'static str);
    impl std::fmt::Display for DriverText {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }
    impl std::error::Error for DriverText {}

    #[test]
    fn cuda_out_of_memory_from_candle_is_retryable_out_of_memory() {
        let oom = candle_core::Error::Cuda(Box::new(DriverText(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
        )))
        .bt();
        let e = Error::tensor("linear `proj.weight`", oom);
        assert!(e.is_retryable(), "{e}");
        assert!(matches!(e, Error::OutOfMemory { .. }), "{e:?}");
        let msg = e.to_string();
        assert!(
            msg.contains("proj.weight") && msg.contains("cuda") && !msg.contains("0 B"),
            "{msg}"
        );
        let cublas = candle_core::Error::Cuda(Box::new(DriverText(
            "cublas error: CUBLAS_STATUS_ALLOC_FAILED",
        )));
        assert!(Error::from(cublas).is_retryable());
        // Other CUDA errors and other candle errors are not.
        let launch = candle_core::Error::Cuda(Box::new(DriverText(
            "DriverError(CUDA_ERROR_LAUNCH_FAILED, \"unspecified launch failure\")",
        )));
        assert!(!Error::from(launch).is_retryable());
        assert!(!Error::from(candle_core::Error::Msg("shape".into())).is_retryable());
    }
}
