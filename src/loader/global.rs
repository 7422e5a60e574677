//! The process-wide manager: [`global`] and [`init_global`].

use once_cell::sync::OnceCell;

use crate::error::Result;
use crate::vram::{Config, Hardware, Policy};

use super::MemoryManager;

static GLOBAL: OnceCell<MemoryManager> = OnceCell::new();

/// The process-wide manager, built on first use from the `RESIDENCY_*` environment variables
/// ([`Config::from_env_vars_lenient`]: a bad variable is reported and left out, the valid ones
/// still apply) and [`Hardware::probe`] — unless [`init_global`] built it first.
pub fn global() -> &'static MemoryManager {
    GLOBAL.get_or_init(|| {
        let (config, errors) = Config::from_env_vars_lenient(std::env::vars());
        for e in errors {
            // Printed as well as traced: an engine without a tracing subscriber would otherwise
            // run on a configuration the user did not ask for without a word.
            eprintln!("residency: ignoring a RESIDENCY_* setting: {e}");
            tracing::warn!(error = %e, "ignoring a RESIDENCY_* setting");
        }
        manager_for(config)
    })
}

/// Builds the process-wide manager from `config` (an engine that reads its own command line) and
/// [`Hardware::probe`], and returns it; [`global`] and the free functions use it from then on.
///
/// # Errors
/// [`Error::GlobalAlreadyInitialized`](crate::Error::GlobalAlreadyInitialized) when the global
/// manager exists already (built by an earlier call of this or of [`global`]); the policy's
/// errors (a `--cuda-device` the machine does not have) as [`MemoryManager::new`] gives them.
pub fn init_global(config: Config) -> Result<&'static MemoryManager> {
    if GLOBAL.get().is_some() {
        return Err(crate::Error::GlobalAlreadyInitialized);
    }
    let manager = MemoryManager::new(config, Hardware::probe())?;
    GLOBAL
        .try_insert(manager)
        .map_err(|_| crate::Error::GlobalAlreadyInitialized)
}

/// A manager for `config`, or for the default configuration when `config` does not resolve on
/// this machine (the default names no CUDA device, so it always resolves).
fn manager_for(config: Config) -> MemoryManager {
    let hardware = Hardware::probe();
    match Policy::new(config, hardware.clone()) {
        Ok(policy) => MemoryManager::with_policy(policy),
        Err(e) => {
            tracing::warn!(error = %e, "falling back to the default configuration");
            crate::warnings::echo("config-fallback", || {
                format!("falling back to the default configuration: {e}")
            });
            let policy = Policy::new(Config::default(), hardware.clone()).unwrap_or_else(|_| {
                Policy::new(Config::default(), Hardware::cpu_only(hardware.host.total))
                    .unwrap_or_else(|_| unreachable!())
            });
            MemoryManager::with_policy(policy)
        }
    }
}
