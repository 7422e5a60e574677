//! The `WARN` events logged while a closure runs, as text (what an engine's log would show).

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

/// The `WARN` events of a load: each one's message and fields, as text.
#[derive(Clone, Default)]
pub struct Warnings(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                let _ = write!(self.0, "{}={value:?}; ", field.name());
            }
        }
        if *event.metadata().level() == tracing::Level::WARN {
            let mut text = Text(String::new());
            event.record(&mut text);
            self.0.lock().unwrap().push(text.0);
        }
    }
}

/// The warnings logged while `f` runs.
pub fn warnings_of(f: impl FnOnce()) -> Vec<String> {
    use tracing_subscriber::layer::SubscriberExt;
    let warnings = Warnings::default();
    let subscriber = tracing_subscriber::registry().with(warnings.clone());
    tracing::subscriber::with_default(subscriber, f);
    let out = warnings.0.lock().unwrap().clone();
    out
}
