//! `cargo run -p lockstep-gpu --example write_quantized_model -- FILE [--bench|--legacy]`: writes
//! the tiny K-quant Llama of `gpu/tests/quantized` to FILE, for
//! `gpu/tests/goldens/make_quantized_goldens.py`; with `--legacy` the same shape in the 32-element
//! block types (its goldens: the script's second argument); with `--bench` the K-quant model's
//! 151M-parameter shape, for the decode benchmark.

#[path = "../tests/quantized/mod.rs"]
mod quantized;

fn main() {
    let Some(file) = std::env::args().nth(1) else {
        eprintln!("usage: write_quantized_model FILE");
        std::process::exit(2);
    };
    let shape = match std::env::args().nth(2).as_deref() {
        None => &quantized::TINY,
        Some("--bench") => &quantized::BENCH,
        Some("--legacy") => &quantized::LEGACY,
        Some(other) => {
            eprintln!(
                "unknown option {other:?}: usage: write_quantized_model FILE [--bench|--legacy]"
            );
            std::process::exit(2);
        }
    };
    if let Err(e) = std::fs::write(&file, quantized::bytes_of(shape)) {
        eprintln!("write {file}: {e}");
        std::process::exit(1);
    }
    println!("{file}");
}
