//! Unit tests of flag parsing: every flag, spellings, conflicts, values, the environment.

use super::*;

#[test]
fn every_flag_parses() {
    for flag in Config::known_flags() {
        let args: Vec<String> = match Config::flag_takes_value(flag) {
            Some(true) => {
                let v = match flag {
                    "--reserve-vram" => "1.5",
                    "--cuda-device" => "1",
                    "--sim-gpus" => "2x4GiB",
                    _ => "4GiB",
                };
                vec![flag.into(), v.into()]
            }
            _ => vec![flag.into()],
        };
        let r = Config::from_args(&args);
        if flag == "--fp64-unet" || flag == "--fp8_e8m0fnu-unet" {
            let msg = r.unwrap_err().to_string();
            assert!(msg.contains(flag), "{msg}");
        } else {
            let cfg = r.unwrap_or_else(|e| panic!("{flag}: {e}"));
            assert_ne!(cfg, Config::default(), "{flag} changed nothing");
        }
    }
}

#[test]
fn values_land_in_their_fields() {
    let cfg = Config::from_args([
        "--lowvram",
        "--reserve-vram",
        "1.5",
        "--vram-budget=512MiB",
        "--async-offload",
        "3",
        "--fp8-e4m3fn-unet",
        "--bf16-vae",
        "--fp16-text-enc",
        "--use-quad-cross-attention",
        "--dont-upcast-attention",
        "--cuda-device",
        "1",
        "--pinned-memory-limit",
        "2GiB",
        "--ram-budget",
        "6GiB",
    ])
    .unwrap();
    assert_eq!(cfg.ram_budget, Some(ByteSize::gib(6)));
    assert_eq!(cfg.vram_mode, Some(VramMode::LowVram));
    assert_eq!(cfg.reserve_vram_gb, Some(1.5));
    assert_eq!(cfg.vram_budget, Some(ByteSize::mib(512)));
    assert_eq!(cfg.async_offload, Some(Some(3)));
    assert_eq!(cfg.transfer_lanes(), 3);
    assert_eq!(cfg.unet_dtype, Some(Dtype::F8E4M3FN));
    assert_eq!(cfg.vae_dtype, Some(Dtype::BF16));
    assert_eq!(cfg.text_encoder_dtype, Some(Dtype::F16));
    assert_eq!(cfg.attention, Some(AttentionFlag::Quad));
    assert_eq!(cfg.upcast_attention, UpcastFlag::Never);
    assert_eq!(cfg.cuda_device, Some(1));
    assert_eq!(cfg.pinned_memory_limit, Some(ByteSize::gib(2)));
}

#[test]
fn async_offload_number_is_optional() {
    let cfg = Config::from_args(["--async-offload", "--lowvram"]).unwrap();
    assert_eq!(cfg.async_offload, Some(None));
    assert_eq!(cfg.transfer_lanes(), 2);
    assert_eq!(Config::default().transfer_lanes(), 2);
    let cuda = crate::vram::DeviceId::Cuda(0);
    let cpu = crate::vram::DeviceId::Cpu;
    assert_eq!(Config::default().transfer_lanes_for(cuda), 2);
    assert_eq!(Config::default().transfer_lanes_for(cpu), 0);
    assert_eq!(
        cfg.transfer_lanes_for(cpu),
        2,
        "a bare --async-offload on the CPU"
    );
    let cfg = Config::from_args(["--disable-async-offload"]).unwrap();
    assert_eq!(cfg.transfer_lanes(), 0);
    assert!(Config::from_args(["--async-offload=0"]).is_err());
}

#[test]
fn conflicting_flags_are_rejected_naming_both() {
    let pairs = [
        ("--lowvram", "--highvram"),
        ("--cpu", "--novram"),
        ("--force-fp16", "--force-fp32"),
        ("--fp16-unet", "--bf16-unet"),
        ("--fp16-vae", "--fp32-vae"),
        ("--fp16-text-enc", "--bf16-text-enc"),
        ("--use-split-cross-attention", "--use-flash-attention"),
        ("--force-upcast-attention", "--dont-upcast-attention"),
        ("--async-offload", "--disable-async-offload"),
    ];
    for (a, b) in pairs {
        match Config::from_args([a, b]) {
            Err(Error::ConflictingFlags { first, second }) => {
                assert_eq!((first.as_str(), second.as_str()), (a, b))
            }
            other => panic!("{a} {b}: {other:?}"),
        }
    }
    // The same flag twice is not a conflict.
    assert!(Config::from_args(["--lowvram", "--lowvram"]).is_ok());
}

#[test]
fn unknown_flags_are_errors_with_a_suggestion() {
    match Config::from_args(["--lowvarm"]) {
        Err(Error::UnknownFlag { flag, suggestion }) => {
            assert_eq!(flag, "--lowvram".replace("vram", "varm"));
            assert_eq!(suggestion.as_deref(), Some("--lowvram"));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        Config::from_args(["--frobnicate-everything"]),
        Err(Error::UnknownFlag {
            suggestion: None,
            ..
        })
    ));
    assert!(matches!(
        Config::from_args(["positional"]),
        Err(Error::UnknownFlag { .. })
    ));
}

#[test]
fn bad_values_name_the_flag() {
    for args in [
        vec!["--vram-budget", "lots"],
        vec!["--vram-budget"],
        vec!["--vram-budget", "0"],
        vec!["--reserve-vram", "-1"],
        vec!["--reserve-vram", "x"],
        vec!["--cuda-device", "gpu0"],
        vec!["--lowvram=1"],
        vec!["--pinned-memory-limit", "4 parsecs"],
        vec!["--ram-budget", "0"],
        vec!["--ram-budget", "some"],
        vec!["--prepared-host", "lots"],
    ] {
        let err = Config::from_args(&args).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains(args[0].trim_end_matches("=1"))
                || msg.contains(args.get(1).unwrap_or(&"")),
            "{args:?}: {msg}"
        );
    }
}

#[test]
fn environment_variables_map_onto_flags() {
    let cfg = Config::from_env_vars([
        ("RESIDENCY_ARGS", "--novram --async-offload 4"),
        ("RESIDENCY_VRAM_BUDGET", "3GiB"),
        ("RESIDENCY_CPU_VAE", "1"),
        ("RESIDENCY_DETERMINISTIC", "0"),
        ("RESIDENCY_FP8_E5M2_UNET", "true"),
        ("RESIDENCY_RAM_BUDGET", "1.5GiB"),
        ("PATH", "/usr/bin"),
    ])
    .unwrap();
    assert_eq!(cfg.ram_budget, Some(ByteSize::mib(1536)));
    assert_eq!(cfg.vram_mode, Some(VramMode::NoVram));
    assert_eq!(cfg.transfer_lanes(), 4);
    assert_eq!(cfg.vram_budget, Some(ByteSize::gib(3)));
    assert!(cfg.cpu_vae);
    assert!(!cfg.deterministic);
    assert_eq!(cfg.unet_dtype, Some(Dtype::F8E5M2));
    let err = Config::from_env_vars([("RESIDENCY_LOWVRAN", "1")]).unwrap_err();
    assert!(err.to_string().contains("RESIDENCY_LOWVRAM"), "{err}");
    assert!(Config::from_env_vars([("RESIDENCY_LOWVRAM", "maybe")]).is_err());
    assert_eq!(
        Config::from_env_vars(Vec::<(String, String)>::new()).unwrap(),
        Config::default()
    );
}

#[test]
fn builder_setters_match_parsed_flags() {
    let built = Config::default()
        .with_vram_mode(VramMode::LowVram)
        .with_vram_budget(ByteSize::gib(4))
        .with_ram_budget(ByteSize::gib(2))
        .with_transfer_lanes(0);
    let parsed = Config::from_args([
        "--lowvram",
        "--vram-budget",
        "4GiB",
        "--ram-budget",
        "2GiB",
        "--disable-async-offload",
    ])
    .unwrap();
    assert_eq!(built, parsed);
}

#[test]
fn every_memory_flag_has_a_builder_setter_that_parses_the_same() {
    let built = Config::default()
        .with_device_vram_budget(1, ByteSize::gib(12))
        .with_device_reserve_vram_gb(0, 1.5)
        .with_reserve_vram_gb(0.5)
        .with_inference_memory(ByteSize::mib(512))
        .with_vae_dtype(Dtype::BF16)
        .with_text_encoder_dtype(Dtype::F16)
        .with_upcast_attention(UpcastFlag::Force)
        .with_cuda_device(0)
        .with_prepared_host(ByteSize::mib(256))
        .with_deterministic(true);
    let parsed = Config::from_args([
        "--vram-budget",
        "1=12GiB",
        "--reserve-vram",
        "0=1.5",
        "--reserve-vram",
        "0.5",
        "--inference-memory",
        "512MiB",
        "--bf16-vae",
        "--fp16-text-enc",
        "--force-upcast-attention",
        "--cuda-device",
        "0",
        "--prepared-host",
        "256MiB",
        "--deterministic",
    ]);
    assert_eq!(Ok(built), parsed.map_err(|e| e.to_string()));
}

#[test]
fn the_help_lists_every_flag_with_the_value_it_takes() {
    let help = Config::flags_help();
    for flag in Config::known_flags() {
        let line = help
            .lines()
            .find(|l| l.trim_start().split(' ').next() == Some(flag))
            .unwrap_or_else(|| panic!("{flag} missing from\n{help}"));
        let takes = Config::flag_takes_value(flag);
        assert_eq!(
            line.trim() != flag,
            takes != Some(false),
            "{flag}: `{line}` (takes a value: {takes:?})"
        );
    }
    assert!(help.contains("--sim-gpu SIZE[@BANDWIDTH]"), "{help}");
}

#[test]
fn prepared_host_copies_take_the_flag_s_room_else_a_quarter_of_available_ram_and_none_under_a_ram_budget(
) {
    let available = ByteSize::gib(32);
    assert_eq!(
        Config::default().prepared_host_limit(available),
        ByteSize::gib(8)
    );
    let budgeted = Config::default().with_ram_budget(ByteSize::gib(4));
    assert_eq!(budgeted.prepared_host_limit(available), ByteSize::ZERO);
    assert_eq!(
        budgeted
            .with_prepared_host(ByteSize::gib(1))
            .prepared_host_limit(available),
        ByteSize::gib(1),
        "the flag wins"
    );
    let off = Config::from_args(["--prepared-host", "0"]).unwrap();
    assert_eq!(off.prepared_host, Some(ByteSize::ZERO));
    assert_eq!(off.prepared_host_limit(available), ByteSize::ZERO);
}
