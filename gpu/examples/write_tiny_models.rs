//! `cargo run -p lockstep-gpu --example write_tiny_models -- DIR`: writes the tiny Hugging Face
//! models of `gpu/tests/tiny` into DIR/<variant>, for `gpu/tests/goldens/make_hf_tiny_goldens.py`.

#[path = "../tests/tiny/mod.rs"]
mod tiny;

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: write_tiny_models DIR");
        std::process::exit(2);
    };
    for variant in tiny::variants() {
        let path = std::path::Path::new(&dir).join(variant.name);
        variant.write(&path);
        println!("{}", path.display());
    }
}
