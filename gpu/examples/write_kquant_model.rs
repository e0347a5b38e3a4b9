//! `cargo run -p lockstep-gpu --example write_kquant_model -- FILE [--bench]`: writes the tiny
//! K-quant Llama of `gpu/tests/kquant` to FILE, for `gpu/tests/goldens/make_kquant_goldens.py`,
//! or with `--bench` its 151M-parameter shape, for the decode benchmark.

#[path = "../tests/kquant/mod.rs"]
mod kquant;

fn main() {
    let Some(file) = std::env::args().nth(1) else {
        eprintln!("usage: write_kquant_model FILE");
        std::process::exit(2);
    };
    let shape = match std::env::args().nth(2).as_deref() {
        None => &kquant::TINY,
        Some("--bench") => &kquant::BENCH,
        Some(other) => {
            eprintln!("unknown option {other:?}: usage: write_kquant_model FILE [--bench]");
            std::process::exit(2);
        }
    };
    if let Err(e) = std::fs::write(&file, kquant::bytes_of(shape)) {
        eprintln!("write {file}: {e}");
        std::process::exit(1);
    }
    println!("{file}");
}
