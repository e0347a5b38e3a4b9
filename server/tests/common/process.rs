//! A `lockstep` child process for the tests that run the binary: killed and reaped when dropped,
//! so a failing test leaves no server behind; and a free port on 127.0.0.1 to give it.

use std::process::Child;

pub struct Process(pub Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port nothing listens on now (the OS's pick, released at once).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}
