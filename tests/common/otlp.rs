//! An OTLP/HTTP receiver in the test process on 127.0.0.1: it answers every request 200
//! and decodes each protobuf body, `/v1/traces` into spans and `/v1/metrics` into data
//! points, as a collector would.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue, any_value::Value};
use opentelemetry_proto::tonic::metrics::v1::{metric::Data, number_data_point};
use opentelemetry_proto::tonic::resource::v1::Resource;
use prost::Message as _;

/// A span as the receiver got it.
#[derive(Debug, Clone)]
pub struct ExportedSpan {
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub group_id: Option<String>,
    /// The trace ids of its links.
    pub links: Vec<String>,
}

/// One data point of an exported metric: a counter's or gauge's value, or a histogram's
/// count (with its sum).
#[derive(Debug, Clone)]
pub struct ExportedPoint {
    pub service: String,
    pub metric: String,
    pub unit: String,
    pub attrs: BTreeMap<String, String>,
    pub value: f64,
    pub sum: Option<f64>,
}

/// What the receiver has decoded so far.
#[derive(Debug, Default)]
pub struct Received {
    pub spans: Vec<ExportedSpan>,
    pub points: Vec<ExportedPoint>,
}

impl Received {
    /// The newest value of `metric` per attribute set whose attributes include `filter`
    /// (cumulative counters: the total so far).
    pub fn latest(&self, metric: &str, filter: &[(&str, &str)]) -> Vec<ExportedPoint> {
        let mut by: BTreeMap<String, ExportedPoint> = BTreeMap::new();
        for p in self.points.iter().filter(|p| {
            p.metric == metric
                && filter
                    .iter()
                    .all(|(k, v)| p.attrs.get(*k).map(String::as_str) == Some(*v))
        }) {
            by.insert(format!("{}{:?}", p.service, p.attrs), p.clone());
        }
        by.into_values().collect()
    }
}

fn text(v: &Option<AnyValue>) -> Option<String> {
    match v.as_ref()?.value.as_ref()? {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(i) => Some(i.to_string()),
        Value::DoubleValue(d) => Some(d.to_string()),
        Value::BoolValue(b) => Some(b.to_string()),
        _ => None,
    }
}

fn attrs(kv: &[KeyValue]) -> BTreeMap<String, String> {
    kv.iter()
        .filter_map(|a| Some((a.key.clone(), text(&a.value)?)))
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The `service.name` of an export's resource ("" when it has none).
fn service_name(resource: Option<&Resource>) -> String {
    resource
        .and_then(|r| attrs(&r.attributes).remove("service.name"))
        .unwrap_or_default()
}

fn decode(path: &str, body: &[u8], out: &Mutex<Received>) {
    match path {
        "/v1/traces" => {
            let req = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf trace export");
            for rs in req.resource_spans {
                let service = service_name(rs.resource.as_ref());
                for s in rs.scope_spans.into_iter().flat_map(|ss| ss.spans) {
                    out.lock().unwrap().spans.push(ExportedSpan {
                        service: service.clone(),
                        name: s.name.clone(),
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        group_id: attrs(&s.attributes).remove("group_id"),
                        links: s.links.iter().map(|l| hex(&l.trace_id)).collect(),
                    });
                }
            }
        }
        "/v1/metrics" => {
            let req = ExportMetricsServiceRequest::decode(body).expect("an OTLP protobuf metrics export");
            for rm in req.resource_metrics {
                let service = service_name(rm.resource.as_ref());
                for m in rm.scope_metrics.into_iter().flat_map(|s| s.metrics) {
                    let point = |attributes: &[KeyValue], value: f64, sum: Option<f64>| ExportedPoint {
                        service: service.clone(),
                        metric: m.name.clone(),
                        unit: m.unit.clone(),
                        attrs: attrs(attributes),
                        value,
                        sum,
                    };
                    let number = |v: &Option<number_data_point::Value>| match v {
                        Some(number_data_point::Value::AsDouble(d)) => *d,
                        Some(number_data_point::Value::AsInt(i)) => *i as f64,
                        None => f64::NAN,
                    };
                    let points: Vec<ExportedPoint> = match &m.data {
                        Some(Data::Sum(s)) => s
                            .data_points
                            .iter()
                            .map(|p| point(&p.attributes, number(&p.value), None))
                            .collect(),
                        Some(Data::Gauge(g)) => g
                            .data_points
                            .iter()
                            .map(|p| point(&p.attributes, number(&p.value), None))
                            .collect(),
                        Some(Data::Histogram(h)) => h
                            .data_points
                            .iter()
                            .map(|p| point(&p.attributes, p.count as f64, p.sum))
                            .collect(),
                        _ => Vec::new(),
                    };
                    out.lock().unwrap().points.extend(points);
                }
            }
        }
        _ => {}
    }
}

/// Starts the receiver; its port, and what it has decoded.
pub fn receiver() -> (u16, Arc<Mutex<Received>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let received = Arc::new(Mutex::new(Received::default()));
    let out = received.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let out = out.clone();
            std::thread::spawn(move || {
                let mut w = conn.try_clone().unwrap();
                let mut r = BufReader::new(conn);
                // Keep-alive: one request after another on the connection.
                loop {
                    let mut line = String::new();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
                    let mut len = 0;
                    loop {
                        let mut h = String::new();
                        if r.read_line(&mut h).unwrap_or(0) == 0 {
                            return;
                        }
                        if h == "\r\n" {
                            break;
                        }
                        if let Some((k, v)) = h.split_once(':')
                            && k.eq_ignore_ascii_case("content-length")
                        {
                            len = v.trim().parse().unwrap();
                        }
                    }
                    let mut body = vec![0; len];
                    r.read_exact(&mut body).unwrap();
                    decode(&path, &body, &out);
                    w.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
                    )
                    .unwrap();
                }
            });
        }
    });
    (port, received)
}
