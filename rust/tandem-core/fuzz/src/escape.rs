//! The wire decoder turns a panic inside arrow-ipc into an error (its unwind guard), so a
//! panic the decoder catches is not a bug; one that escapes `decode_frame` or `FrameReader`,
//! or an assertion of the target, is. libFuzzer's panic hook aborts on every panic, caught
//! or not: `init` replaces it with one that only remembers the message, and `check` aborts
//! (reporting a crash) when a panic unwinds out of the target's body.

use std::cell::RefCell;
use std::panic::{self, AssertUnwindSafe};

thread_local! {
    static LAST_PANIC: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Replace libFuzzer's abort-on-any-panic hook (call from the target's `init`).
pub fn init() {
    panic::set_hook(Box::new(|info| {
        let message = info.to_string();
        LAST_PANIC.with(|last| *last.borrow_mut() = message);
    }));
}

/// Run `body`; abort, printing the panic, if a panic escapes it.
pub fn check(body: impl FnOnce()) {
    if panic::catch_unwind(AssertUnwindSafe(body)).is_err() {
        LAST_PANIC.with(|last| eprintln!("panic escaped the fuzz target: {}", last.borrow()));
        std::process::abort();
    }
}
