//! `cargo run -p lockstep-gpu --example write_quantized_model -- FILE [--legacy|--q5_k_m|--bench]`:
//! writes one of the generated Llamas of `gpu/tests/quantized` to FILE: the tiny K-quant one
//! (`TINY`), or `LEGACY` or `Q5_K_M`, for `gpu/tests/goldens/make_quantized_goldens.py`; or with
//! `--bench` the K-quant mix at 151M parameters, for the decode benchmark.

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
        Some("--q5_k_m") => &quantized::Q5_K_M,
        Some(other) => {
            eprintln!(
                "unknown option {other:?}: usage: write_quantized_model FILE [--bench|--legacy|--q5_k_m]"
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
