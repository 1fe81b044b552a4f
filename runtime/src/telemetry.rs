//! Logging, tracing and metrics: `tracing` to stderr; spans and metrics exported over
//! OTLP/HTTP (protobuf) when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (the instruments are in
//! [`crate::instruments`]); and W3C `traceparent` propagation through message headers so a
//! trajectory can be followed across stages and processes.

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use crate::{Error, Result};

/// Keeps the span and metric exporters alive; flushes both on drop.
pub struct TelemetryGuard {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
    meters: Option<opentelemetry_sdk::metrics::SdkMeterProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
        if let Some(m) = self.meters.take() {
            let _ = m.shutdown();
        }
    }
}

/// Installs the global subscriber: logs filtered by `RUST_LOG` (default `info`), plus,
/// when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, an OTLP span exporter (`/v1/traces`) and the
/// global meter provider with an OTLP metric exporter (`/v1/metrics`, every
/// `OTEL_METRIC_EXPORT_INTERVAL` ms). Call it before any stage is built: instruments bind to
/// the provider in place at their first use. Safe to call twice (the second call is a no-op).
pub fn init(service: &str) -> Result<TelemetryGuard> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        // Colours for a terminal only: a log file or `docker logs` gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false);
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty());
    let Some(endpoint) = endpoint else {
        let _ = tracing_subscriber::registry().with(filter).with(fmt).try_init();
        return Ok(TelemetryGuard {
            provider: None,
            meters: None,
        });
    };
    use opentelemetry_otlp::WithExportConfig;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
        .build()
        .map_err(|e| Error::Telemetry(format!("OTLP exporter for `{endpoint}`: {e}")))?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service.to_string())
        .build();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.clone())
        .build();
    let metric_exporter = opentelemetry_otlp::MetricExporter::builder()
        .with_http()
        .with_endpoint(format!("{}/v1/metrics", endpoint.trim_end_matches('/')))
        .build()
        .map_err(|e| Error::Telemetry(format!("OTLP metric exporter for `{endpoint}`: {e}")))?;
    let meters = opentelemetry_sdk::metrics::SdkMeterProvider::builder()
        .with_periodic_exporter(metric_exporter)
        .with_resource(resource)
        .build();
    opentelemetry::global::set_meter_provider(meters.clone());
    METRICS.store(true, std::sync::atomic::Ordering::Relaxed);
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("streamrl"));
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(layer)
        .try_init();
    Ok(TelemetryGuard {
        provider: Some(provider),
        meters: Some(meters),
    })
}

static METRICS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether [`init`] installed a metric exporter (work done only to feed an instrument, such
/// as sampling the input lag, is skipped otherwise).
pub fn metrics_enabled() -> bool {
    METRICS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The span a stage processes one message in, parented to the producer's trace: exported
/// as `name` (the stage kind's verb: `execute`, `score`, ...), with the instance, topic,
/// and (recorded once known) the message's group ids, rows and policy version.
pub fn consume_span(name: &str, instance: &str, topic: &str, traceparent: Option<&str>) -> tracing::Span {
    let span = tracing::info_span!(
        "process",
        otel.name = %name,
        stage = %instance,
        topic = %topic,
        group_id = tracing::field::Empty,
        rows = tracing::field::Empty,
        policy_version = tracing::field::Empty,
    );
    if let Some(tp) = traceparent {
        let mut carrier = HashMap::new();
        carrier.insert("traceparent".to_string(), tp.to_string());
        let cx = TraceContextPropagator::new().extract(&carrier);
        let _ = span.set_parent(cx);
    }
    span
}

/// The first span of a trajectory's trace, for a group that starts in this stage (the
/// source admitting it): a root, exported as `name` with the group id and its rows.
pub fn root_span(name: &str, instance: &str, group_id: &str, rows: usize) -> tracing::Span {
    tracing::info_span!(
        parent: None,
        "process",
        otel.name = %name,
        stage = %instance,
        group_id = %group_id,
        rows = rows as i64,
    )
}

/// A root span for work that consumes many trajectories at once (the trainer's
/// `train-step`): a trace of its own, exported as `name`, with a link to each context in
/// `linked` (W3C traceparents; malformed ones are skipped), so a backend can go from a
/// step to every group it trained on and back.
pub fn linked_span(name: &str, instance: &str, linked: &[String]) -> tracing::Span {
    let span = tracing::info_span!(
        parent: None,
        "step",
        otel.name = %name,
        stage = %instance,
        policy_version = tracing::field::Empty,
        groups = linked.len() as i64,
        samples = tracing::field::Empty,
        trained = tracing::field::Empty,
        tokens = tracing::field::Empty,
        loss = tracing::field::Empty,
    );
    let propagator = TraceContextPropagator::new();
    for tp in linked {
        if parse_traceparent(tp).is_none() {
            continue;
        }
        let mut carrier = HashMap::new();
        carrier.insert("traceparent".to_string(), tp.clone());
        let cx = propagator.extract(&carrier);
        span.add_link(cx.span().span_context().clone());
    }
    span
}

/// The `traceparent` for outputs produced inside `span`: the exported span's context when
/// tracing is on, else the incoming trace (so the trace id still flows end to end), else
/// `None` (the caller starts a new trace).
pub fn traceparent_for(span: &tracing::Span, incoming: Option<&str>) -> Option<String> {
    let cx = span.context();
    if cx.span().span_context().is_valid() {
        let mut carrier: HashMap<String, String> = HashMap::new();
        TraceContextPropagator::new().inject_context(&cx, &mut carrier);
        if let Some(tp) = carrier.remove("traceparent") {
            return Some(tp);
        }
    }
    incoming
        .filter(|tp| parse_traceparent(tp).is_some())
        .map(str::to_string)
}

/// A fresh W3C traceparent (random trace and span ids, sampled).
pub fn new_traceparent() -> String {
    let a = uuid::Uuid::new_v4().simple().to_string();
    let b = uuid::Uuid::new_v4().simple().to_string();
    format!("00-{a}-{}-01", &b[..16])
}

/// Splits a W3C traceparent into (trace id, parent span id) if it is well formed.
pub fn parse_traceparent(tp: &str) -> Option<(&str, &str)> {
    let mut it = tp.split('-');
    let (v, t, s, f) = (it.next()?, it.next()?, it.next()?, it.next()?);
    let hex = |x: &str, n: usize| x.len() == n && x.bytes().all(|b| b.is_ascii_hexdigit());
    (it.next().is_none() && hex(v, 2) && hex(t, 32) && hex(s, 16) && hex(f, 2) && t != "0".repeat(32)).then_some((t, s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_traceparents_are_valid_and_incoming_ones_flow_on() {
        let tp = new_traceparent();
        assert!(parse_traceparent(&tp).is_some(), "{tp}");
        let span = tracing::Span::none();
        assert_eq!(traceparent_for(&span, Some(&tp)), Some(tp.clone()));
        assert_eq!(traceparent_for(&span, Some("garbage")), None);
    }
}
