//! `cargo run -p lockstep-gpu --example write_quantized_model -- FILE [MIX] [--bench]`: writes one
//! of the generated Llamas of `gpu/tests/quantized` to FILE, for
//! `gpu/tests/goldens/make_quantized_goldens.py`: MIX `q4_k_m` (the default, `TINY`), `legacy` or
//! `q5_k_m`; with `--bench`, the same types at 151M parameters, for the decode benchmark.

#[path = "../tests/quantized/mod.rs"]
mod quantized;

const USAGE: &str = "usage: write_quantized_model FILE [q4_k_m|legacy|q5_k_m] [--bench]";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(file) = args.first() else {
        eprintln!("{USAGE}");
        std::process::exit(2);
    };
    let (mut mix, mut bench) = ("q4_k_m", false);
    for arg in &args[1..] {
        match arg.as_str() {
            "q4_k_m" | "legacy" | "q5_k_m" => mix = arg,
            "--bench" => bench = true,
            other => {
                eprintln!("unknown argument {other:?}: {USAGE}");
                std::process::exit(2);
            }
        }
    }
    let shape = match (mix, bench) {
        ("q4_k_m", false) => quantized::TINY,
        // A real Q4_K_M file's embedding and output types, not the goldens' path coverage.
        ("q4_k_m", true) => quantized::BENCH,
        ("legacy", false) => quantized::LEGACY,
        (_, false) => quantized::Q5_K_M,
        ("legacy", true) => quantized::at_bench_size(&quantized::LEGACY),
        (_, true) => quantized::at_bench_size(&quantized::Q5_K_M),
    };
    if let Err(e) = std::fs::write(file, quantized::bytes_of(&shape)) {
        eprintln!("write {file}: {e}");
        std::process::exit(1);
    }
    println!("{file}");
}
