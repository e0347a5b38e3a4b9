//! `sim`: replay a trace on a simulated deployment under faults and judge it (`replay`), search
//! many seeds for a violation (`explore`), or measure how fast simulation goes (`bench`).

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match cli::run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("sim: {e}");
            ExitCode::from(2)
        }
    }
}
