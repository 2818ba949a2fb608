//! Log lines on stderr (supervisord captures them into the router's log file), in the format
//! the Python processes of the pool use: `2026-11-22 10:43:00,123 router INFO message`.
//! Four macros and no logging crate: the front door logs events, never per request.

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Events that may come in floods (connections refused or closed unstarted), logged the
/// first time and then at most once per `Throttle::EVERY`, each line with the count since the
/// last; the count left after a flood's last line is written by the throttle's owner when it
/// looks (`trailing`), so the end of a flood shows without waiting for its next event.
pub struct Throttle {
    /// When the last line was written (None: never), and the events not yet in a line.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub const EVERY: Duration = Duration::from_secs(10);

    pub const fn new() -> Throttle {
        Throttle {
            state: Mutex::new((None, 0)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Option<Instant>, u64)> {
        // Two plain numbers stay whole whatever a panicking holder did.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Counts one event at `now`; Some(events since the last line, this one included) when a
    /// line should be written now.
    pub fn note(&self, now: Instant) -> Option<u64> {
        let mut state = self.lock();
        let (last, pending) = &mut *state;
        *pending += 1;
        match *last {
            Some(at) if now.saturating_duration_since(at) < Self::EVERY => None,
            _ => {
                *last = Some(now);
                Some(std::mem::take(pending))
            }
        }
    }

    /// The events counted since the last line, once `EVERY` has passed since it (None when
    /// there are none, or too soon): for a line of their own, counted as the throttle's line.
    pub fn trailing(&self, now: Instant) -> Option<u64> {
        let mut state = self.lock();
        let (last, pending) = &mut *state;
        match *last {
            Some(at) if *pending > 0 && now.saturating_duration_since(at) >= Self::EVERY => {
                *last = Some(now);
                Some(std::mem::take(pending))
            }
            _ => None,
        }
    }
}

/// UTC `YYYY-MM-DD HH:MM:SS,mmm` (days-from-civil arithmetic, no time-zone database needed).
pub fn timestamp() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02},{:03}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        now.subsec_millis()
    )
}

#[macro_export]
macro_rules! log_at {
    ($level:expr, $($arg:tt)*) => {
        eprintln!("{} router {} {}", $crate::log::timestamp(), $level, format_args!($($arg)*))
    };
}
#[macro_export]
macro_rules! log_info { ($($arg:tt)*) => { $crate::log_at!("INFO", $($arg)*) }; }
#[macro_export]
macro_rules! log_warn { ($($arg:tt)*) => { $crate::log_at!("WARNING", $($arg)*) }; }
#[macro_export]
macro_rules! log_error { ($($arg:tt)*) => { $crate::log_at!("ERROR", $($arg)*) }; }

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttle_lets_the_first_event_through_then_one_line_per_period_with_the_count() {
        let throttle = Throttle::new();
        let start = Instant::now();
        assert_eq!(throttle.note(start), Some(1));
        for second in 1..=5 {
            assert_eq!(throttle.note(start + Duration::from_secs(second)), None);
        }
        assert_eq!(throttle.note(start + Throttle::EVERY), Some(6));
        assert_eq!(throttle.note(start + Throttle::EVERY), None);
        assert_eq!(throttle.note(start + 3 * Throttle::EVERY), Some(2));
    }

    #[test]
    fn what_a_flood_left_after_its_last_line_is_given_once_a_period_has_passed() {
        let throttle = Throttle::new();
        let start = Instant::now();
        assert_eq!(throttle.trailing(start), None, "nothing counted");
        assert_eq!(throttle.note(start), Some(1));
        assert_eq!(
            throttle.trailing(start + Throttle::EVERY),
            None,
            "all in a line"
        );
        for second in 1..=3 {
            assert_eq!(throttle.note(start + Duration::from_secs(second)), None);
        }
        assert_eq!(
            throttle.trailing(start + Duration::from_secs(9)),
            None,
            "too soon"
        );
        let flushed = start + Throttle::EVERY;
        assert_eq!(throttle.trailing(flushed), Some(3));
        assert_eq!(
            throttle.trailing(flushed + Throttle::EVERY),
            None,
            "given once"
        );
        // The trailing line counts as a line: the next event waits its period.
        assert_eq!(throttle.note(flushed + Duration::from_secs(1)), None);
        assert_eq!(throttle.note(flushed + Throttle::EVERY), Some(2));
    }

    #[test]
    fn timestamps_have_the_python_shape() {
        let t = super::timestamp();
        assert_eq!(t.len(), 23, "{t}");
        assert_eq!(&t[4..5], "-");
        assert_eq!(&t[19..20], ",");
        assert!(t.starts_with("20"));
    }
}
