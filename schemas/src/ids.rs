//! How a run names its groups: the source admits group `g` of a run as
//! `<run_id>-g<g, 7 digits>`, for step `g / groups_per_step`, so any stage that knows a
//! step's size can name the groups the step was admitted with (the trainer does, for the
//! groups a step stopped waiting for).
//!
//! ```
//! use streamrl_schemas::ids;
//!
//! assert_eq!(ids::group_id("demo", 42), "demo-g0000042");
//! assert_eq!(ids::group_index("demo", "demo-g0000042"), Some(42));
//! assert_eq!(ids::group_index("other", "demo-g0000042"), None);
//! assert_eq!(ids::step_groups("demo", 3, 2), ["demo-g0000006", "demo-g0000007"]);
//! ```

/// The id of group `index` of run `run_id`.
pub fn group_id(run_id: &str, index: u64) -> String {
    format!("{run_id}-g{index:07}")
}

/// The index of a group id of run `run_id` (`None` for another run's, or another naming).
pub fn group_index(run_id: &str, id: &str) -> Option<u64> {
    let digits = id.strip_prefix(run_id)?.strip_prefix("-g")?;
    if digits.len() < 7 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The ids of the groups admitted for `step`, `groups_per_step` of them.
pub fn step_groups(run_id: &str, step: u64, groups_per_step: u64) -> Vec<String> {
    (step * groups_per_step..(step + 1) * groups_per_step)
        .map(|g| group_id(run_id, g))
        .collect()
}
