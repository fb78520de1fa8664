//! Per-stage wall time of a run: where the time to a verdict goes.
//!
//! A run at real model size spends its time in a few stages (opening the file, dequantizing the
//! layer, the reference, each engine path, the per-site comparison, the diagnosis, writing the
//! report), and which one dominates changes with T, the dtype and the backend. Each stage is
//! wrapped in [`stage`]; `--stats` prints the totals ([`take`]) and the progress bar names the
//! stage being run ([`set_listener`]).
//!
//! The record is per thread: a run's stages all start on the thread that called the job (the
//! parallel work inside a stage is timed as part of it), and tests running side by side in one
//! process never see each other's stages.

use std::cell::RefCell;
use std::time::{Duration, Instant};

/// A function told the name of every stage as it starts (the progress bar's message).
pub type Listener = Box<dyn Fn(&str)>;

thread_local! {
    static STAGES: RefCell<Vec<StageTime>> = const { RefCell::new(Vec::new()) };
    static LISTENER: RefCell<Option<Listener>> = const { RefCell::new(None) };
}

/// Runs `f` as stage `name`, adding its wall time to that stage's total on this thread.
///
/// Stages may nest (a path's `dequant` inside `path mha`): each level is recorded under its own
/// name, so nested totals are parts of their parent's, not additions to it.
pub fn stage<T>(name: &str, f: impl FnOnce() -> T) -> T {
    LISTENER.with(|l| {
        if let Some(l) = l.borrow().as_ref() {
            l(name)
        }
    });
    let t0 = Instant::now();
    let out = f();
    add(name, t0.elapsed());
    out
}

/// Adds `d` to stage `name`'s total on this thread (for work timed by hand).
pub fn add(name: &str, d: Duration) {
    STAGES.with(|s| {
        let mut s = s.borrow_mut();
        match s.iter_mut().find(|e| e.name == name) {
            Some(e) => {
                e.wall += d;
                e.count += 1;
            }
            None => s.push(StageTime {
                name: name.to_string(),
                wall: d,
                count: 1,
            }),
        }
    });
}

/// One stage's total: name, summed wall time and how many times it ran, in first-run order.
#[derive(Debug, Clone, PartialEq)]
pub struct StageTime {
    /// Stage name (`open`, `dequant`, `reference`, `path mha`, `compare`, `diagnose`, …).
    pub name: String,
    /// Summed wall time.
    pub wall: Duration,
    /// Number of times the stage ran.
    pub count: u32,
}

/// Takes (and clears) this thread's stage totals, in the order each stage first ran.
pub fn take() -> Vec<StageTime> {
    STAGES.with(|s| std::mem::take(&mut *s.borrow_mut()))
}

/// Sets (or with `None` clears) this thread's stage listener.
pub fn set_listener(l: Option<Listener>) {
    LISTENER.with(|s| *s.borrow_mut() = l);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_sum_by_name_in_first_run_order_and_nest() {
        let _ = take();
        let seen = std::rc::Rc::new(RefCell::new(Vec::new()));
        let s2 = seen.clone();
        set_listener(Some(Box::new(move |n| s2.borrow_mut().push(n.to_string()))));
        let v = stage("reference", || {
            stage("dequant", || std::thread::sleep(Duration::from_millis(5)));
            7
        });
        stage("path mha", || ());
        add("reference", Duration::from_millis(100));
        set_listener(None);
        assert_eq!(v, 7);
        let t = take();
        let names: Vec<&str> = t.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["dequant", "reference", "path mha"]);
        assert_eq!(t[1].count, 2);
        assert!(t[1].wall >= Duration::from_millis(105), "{:?}", t[1].wall);
        assert!(t[0].wall >= Duration::from_millis(5) && t[0].wall <= t[1].wall);
        assert_eq!(*seen.borrow(), ["reference", "dequant", "path mha"]);
        assert!(take().is_empty(), "take clears");
    }
}
