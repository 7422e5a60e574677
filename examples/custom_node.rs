//! The node author's view: a node receives a `ModelPatcher`, clones it, adds a LoRA from a file,
//! and hands the clone on. The original is untouched.
//!
//! `cargo run --release --example custom_node`

use std::sync::Arc;

use candle_core::{Device, Tensor};
use residency::patcher::{lora_file, ModelPatcher};
use residency::weights::{save_safetensors, SafetensorsOptions};
use residency::{DeviceId, Dtype, Model, Result};

/// What a LoRA-loader node does: clone, patch, return. `strength` scales the LoRA.
fn lora_node(
    input: &ModelPatcher,
    lora_file: &std::path::Path,
    strength: f32,
) -> Result<ModelPatcher> {
    let mut out = input.clone(); // shares weights; patches are copied on write
    let loaded = lora_file::load(lora_file, input.model().keys())?;
    let keys = out.add_patches(loaded.patches, strength, 1.0)?;
    println!(
        "lora node: patched {} weights, ignored {:?}",
        keys.len(),
        loaded.unmatched_lora_keys
    );
    Ok(out)
}

fn main() -> Result<()> {
    residency::tools::cache_candle_thread_count();
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.is_empty() {
        let help = args.iter().any(|a| a == "--help" || a == "-h");
        let usage = "usage: custom_node (no flags: it shows a node cloning a model and adding a LoRA, on the CPU; it takes no residency flags)";
        if help {
            println!("{usage}");
            return Ok(());
        }
        eprintln!("error: unexpected arguments {args:?}\n{usage}");
        std::process::exit(2);
    }
    let dir = std::env::temp_dir().join("residency-custom-node");
    std::fs::create_dir_all(&dir).map_err(|e| residency::Error::File {
        path: dir.clone(),
        reason: e.to_string(),
    })?;
    // The graph's model: one 4×4 linear weight.
    let w = Tensor::arange(0f32, 16., &Device::Cpu)?.reshape((4, 4))?;
    let model = Arc::new(Model::from_tensors(
        "unet",
        [("diffusion_model.proj.weight", w)],
    )?);
    let original = ModelPatcher::new(model, DeviceId::Cpu, DeviceId::Cpu);
    // A LoRA file in kohya naming, as users download them.
    let lora_path = dir.join("style.safetensors");
    let up = Tensor::ones((4, 1), candle_core::DType::F32, &Device::Cpu)?;
    let down = Tensor::new(&[[0.5f32, 0., 0., -0.5]], &Device::Cpu)?;
    save_safetensors(
        &lora_path,
        &[
            ("lora_unet_proj.lora_up.weight", up, Dtype::F32),
            ("lora_unet_proj.lora_down.weight", down, Dtype::F32),
        ],
        &SafetensorsOptions::default(),
    )?;

    let styled = lora_node(&original, &lora_path, 2.0)?;
    let before = original.patched_weight("diffusion_model.proj.weight")?;
    let after = styled.patched_weight("diffusion_model.proj.weight")?;
    println!("original row 0: {:?}", before.get(0)?.to_vec1::<f32>()?);
    println!("styled   row 0: {:?}", after.get(0)?.to_vec1::<f32>()?);
    println!(
        "same model: {}, original patches: {}",
        styled.is_clone(&original),
        original.patches().len()
    );
    Ok(())
}
