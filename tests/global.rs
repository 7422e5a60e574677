//! The process-wide manager: an engine configures it from its own command line with
//! `init_global`, once; `global()` then returns that manager. (Its own test binary: the global
//! is per process.)

use residency::vram::{Config, VramState};
use residency::{ByteSize, Error};

#[test]
fn init_global_configures_the_process_manager_once() {
    let config = Config::from_args(["--novram", "--vram-budget", "64MiB"]).unwrap();
    let mm = residency::init_global(config).unwrap();
    assert_eq!(mm.policy().vram_state(), VramState::NoVram);
    assert!(
        std::ptr::eq(mm, residency::global()),
        "global() is that manager"
    );
    assert_eq!(
        residency::global().get_total_memory(residency::DeviceId::Cpu),
        ByteSize::mib(64)
    );
    let again = residency::init_global(Config::default());
    assert!(matches!(again, Err(Error::GlobalAlreadyInitialized)));
    assert_eq!(residency::global().policy().vram_state(), VramState::NoVram);
}

#[test]
fn a_bad_environment_variable_leaves_the_valid_ones_in_force() {
    let (config, errors) = Config::from_env_vars_lenient([
        ("RESIDENCY_VRAM_BUDGET", "4GiB"),
        ("RESIDENCY_BOGUS_FLAG", "1"),
        ("RESIDENCY_LOWVRAM", "1"),
        ("RESIDENCY_NOVRAM", "1"),
        ("RESIDENCY_RESERVE_VRAM", "lots"),
        ("PATH", "/usr/bin"),
    ]);
    assert_eq!(config.vram_budget, Some(ByteSize::gib(4)));
    assert_eq!(config.vram_mode, Some(residency::vram::VramMode::LowVram));
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(errors
        .iter()
        .any(|e| matches!(e, Error::UnknownFlag { .. })));
    assert!(errors
        .iter()
        .any(|e| matches!(e, Error::ConflictingFlags { .. })));
    assert!(errors
        .iter()
        .any(|e| matches!(e, Error::InvalidFlag { .. })));
    // The strict reader still refuses the whole set.
    assert!(Config::from_env_vars([("RESIDENCY_BOGUS_FLAG", "1")]).is_err());
}
