//! A `lockstep` child process for the tests that run the binary: killed and reaped when dropped,
//! so a failing test leaves no server behind; and a free port on 127.0.0.1 to give it.

use std::path::Path;
use std::process::{Child, Command, Stdio};

pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port nothing listens on now (the OS's pick, released at once).
#[allow(dead_code, reason = "not every test that runs the binary needs a single port")]
pub fn free_port() -> u16 {
    let [port] = free_ports();
    port
}

/// `N` distinct ports nothing listens on now. Every listener is held until all are picked: the
/// OS may hand a released port out again at once, and did (CI's decode worker once found its
/// port taken by the prefill worker's, picked a moment before by a separate call).
#[allow(dead_code, reason = "not every test that runs the binary needs several ports")]
pub fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: [std::net::TcpListener; N] =
        std::array::from_fn(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free port"));
    listeners.map(|listener| listener.local_addr().expect("its address").port())
}

/// `lockstep serve --model MODEL ARGS`, its standard error appended to `log`.
#[allow(dead_code, reason = "not every test that runs the binary loads a model")]
pub fn serve_model(model: &Path, args: &[&str], log: &Path) -> Process {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("the log");
    let child = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args(args)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("lockstep serve");
    Process(child)
}
