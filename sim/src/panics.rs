//! Panics inside simulated hosts, caught. An engine that finds a broken invariant stops with a
//! panic naming it (`--check-invariants`); tokio catches a task's panic and the host lives on
//! without its engine, so the run would only see the symptom (requests that never end). A panic
//! hook sees every one first and keeps its message, per thread, while a run captures: the
//! invariant oracle's evidence. Runs on other threads (`sim explore --jobs`) keep their own.

use std::cell::RefCell;
use std::sync::Once;

thread_local! {
    static CAPTURED: RefCell<Option<Vec<String>>> = const { RefCell::new(None) };
}

static HOOK: Once = Once::new();

/// Starts capturing this thread's panics (and stops them printing).
pub fn start_capture() {
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let captured = CAPTURED.with(|c| {
                let mut c = c.borrow_mut();
                let Some(list) = c.as_mut() else { return false };
                let at = turmoil::sim_elapsed()
                    .map(|t| format!(" at {:.3} ms", t.as_secs_f64() * 1e3))
                    .unwrap_or_default();
                let location = info
                    .location()
                    .map(|l| format!(" ({}:{})", l.file(), l.line()))
                    .unwrap_or_default();
                list.push(format!("{}{location}{at}", payload(info)));
                true
            });
            if !captured {
                default(info);
            }
        }));
    });
    CAPTURED.with(|c| *c.borrow_mut() = Some(Vec::new()));
}

/// What was captured since `start_capture`, so far.
pub fn captured_so_far() -> usize {
    CAPTURED.with(|c| c.borrow().as_ref().map_or(0, Vec::len))
}

/// Stops capturing; the panics seen.
pub fn finish_capture() -> Vec<String> {
    CAPTURED.with(|c| c.borrow_mut().take().unwrap_or_default())
}

fn payload(info: &std::panic::PanicHookInfo<'_>) -> String {
    if let Some(s) = info.payload().downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = info.payload().downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}
