//! Message headers: what travels beside every payload.

use std::fmt;

use crate::{Error, Result, SchemaId};

/// Headers as they travel on the wire: ordered key/value pairs with byte values (Kafka's
/// header model, which the memory bus keeps too).
pub type WireHeaders = Vec<(String, Vec<u8>)>;

/// Header keys streamrl writes.
pub struct HeaderKey;

impl HeaderKey {
    /// Schema name of the payload.
    pub const SCHEMA: &'static str = "streamrl-schema";
    /// Schema fingerprint of the producer's build.
    pub const FINGERPRINT: &'static str = "streamrl-fingerprint";
    /// Producing stage and replica, e.g. `rollout-1`.
    pub const PRODUCER: &'static str = "streamrl-producer";
    /// W3C trace context.
    pub const TRACEPARENT: &'static str = "traceparent";
    /// Policy version the payload was produced under.
    pub const POLICY_VERSION: &'static str = "streamrl-policy-version";
    /// `data` or `signal`.
    pub const KIND: &'static str = "streamrl-kind";
    /// The in-band control signal (only on signal messages).
    pub const SIGNAL: &'static str = "streamrl-signal";
}

/// Whether a message carries rows or an in-band control signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageKind {
    /// An Arrow payload of the topic's schema.
    Data,
    /// A [`Signal`] with an empty payload.
    Signal,
}

/// In-band control, carried on the data topics themselves (never a side channel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// The producer will send nothing more on this topic.
    EndOfData,
    /// A new policy version is in effect.
    PolicyVersion(u32),
    /// A checkpoint barrier.
    Barrier(u64),
    /// The run is over (the trainer published its last version): every stage that sees
    /// it, on any input, finishes what it holds, commits and exits.
    EndOfRun,
}

impl fmt::Display for Signal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Signal::EndOfData => f.write_str("end_of_data"),
            Signal::PolicyVersion(v) => write!(f, "policy_version:{v}"),
            Signal::Barrier(e) => write!(f, "barrier:{e}"),
            Signal::EndOfRun => f.write_str("end_of_run"),
        }
    }
}

impl std::str::FromStr for Signal {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = |reason: &str| Error::InvalidHeader {
            key: HeaderKey::SIGNAL,
            value: s.to_string(),
            reason: reason.to_string(),
        };
        match s.split_once(':') {
            None if s == "end_of_data" => Ok(Signal::EndOfData),
            None if s == "end_of_run" => Ok(Signal::EndOfRun),
            Some(("policy_version", v)) => v
                .parse()
                .map(Signal::PolicyVersion)
                .map_err(|_| bad("version is not a u32")),
            Some(("barrier", v)) => v.parse().map(Signal::Barrier).map_err(|_| bad("epoch is not a u64")),
            _ => Err(bad("expected end_of_data, end_of_run, policy_version:N or barrier:N")),
        }
    }
}

/// Parsed streamrl headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Headers {
    /// Schema of the payload.
    pub schema: SchemaId,
    /// Fingerprint of that schema in the producer's build.
    pub fingerprint: String,
    /// Producing stage and replica.
    pub producer: String,
    /// W3C `traceparent`, when tracing is on.
    pub traceparent: Option<String>,
    /// Policy version the payload was produced under.
    pub policy_version: Option<u32>,
    /// Data or signal.
    pub kind: MessageKind,
    /// The signal, for signal messages.
    pub signal: Option<Signal>,
}

impl Headers {
    /// Headers for a data message of `schema` from `producer`.
    pub fn data(schema: SchemaId, producer: impl Into<String>) -> Self {
        Headers {
            schema,
            fingerprint: schema.fingerprint().to_string(),
            producer: producer.into(),
            traceparent: None,
            policy_version: None,
            kind: MessageKind::Data,
            signal: None,
        }
    }

    /// Headers for an in-band signal on a topic of `schema`.
    pub fn signal(schema: SchemaId, producer: impl Into<String>, signal: Signal) -> Self {
        Headers {
            kind: MessageKind::Signal,
            signal: Some(signal),
            ..Headers::data(schema, producer)
        }
    }

    /// Sets the policy version.
    pub fn with_policy_version(mut self, v: u32) -> Self {
        self.policy_version = Some(v);
        self
    }

    /// Sets the W3C trace context.
    pub fn with_traceparent(mut self, tp: impl Into<String>) -> Self {
        self.traceparent = Some(tp.into());
        self
    }

    /// To wire form.
    pub fn to_wire(&self) -> WireHeaders {
        let mut h = vec![
            (HeaderKey::SCHEMA.to_string(), self.schema.name().as_bytes().to_vec()),
            (HeaderKey::FINGERPRINT.to_string(), self.fingerprint.as_bytes().to_vec()),
            (HeaderKey::PRODUCER.to_string(), self.producer.as_bytes().to_vec()),
            (
                HeaderKey::KIND.to_string(),
                match self.kind {
                    MessageKind::Data => b"data".to_vec(),
                    MessageKind::Signal => b"signal".to_vec(),
                },
            ),
        ];
        if let Some(tp) = &self.traceparent {
            h.push((HeaderKey::TRACEPARENT.to_string(), tp.as_bytes().to_vec()));
        }
        if let Some(v) = self.policy_version {
            h.push((HeaderKey::POLICY_VERSION.to_string(), v.to_string().into_bytes()));
        }
        if let Some(s) = self.signal {
            h.push((HeaderKey::SIGNAL.to_string(), s.to_string().into_bytes()));
        }
        h
    }

    /// From wire form. Unknown keys are ignored; a missing schema or an invalid value is an
    /// error naming the key.
    pub fn from_wire(wire: &[(String, Vec<u8>)]) -> Result<Self> {
        let get = |key: &'static str| -> Result<Option<&str>> {
            match wire.iter().rev().find(|(k, _)| k == key) {
                None => Ok(None),
                Some((_, v)) => std::str::from_utf8(v).map(Some).map_err(|_| Error::InvalidHeader {
                    key,
                    value: String::from_utf8_lossy(v).into_owned(),
                    reason: "not UTF-8".into(),
                }),
            }
        };
        let schema_name = get(HeaderKey::SCHEMA)?.ok_or(Error::MissingHeader(HeaderKey::SCHEMA))?;
        let schema: SchemaId = schema_name.parse().map_err(|_| Error::InvalidHeader {
            key: HeaderKey::SCHEMA,
            value: schema_name.to_string(),
            reason: "unknown schema".into(),
        })?;
        let kind = match get(HeaderKey::KIND)? {
            None | Some("data") => MessageKind::Data,
            Some("signal") => MessageKind::Signal,
            Some(other) => {
                return Err(Error::InvalidHeader {
                    key: HeaderKey::KIND,
                    value: other.into(),
                    reason: "expected data or signal".into(),
                });
            }
        };
        let policy_version = match get(HeaderKey::POLICY_VERSION)? {
            None => None,
            Some(v) => Some(v.parse().map_err(|_| Error::InvalidHeader {
                key: HeaderKey::POLICY_VERSION,
                value: v.into(),
                reason: "not a u32".into(),
            })?),
        };
        let signal = get(HeaderKey::SIGNAL)?.map(str::parse).transpose()?;
        if kind == MessageKind::Signal && signal.is_none() {
            return Err(Error::MissingHeader(HeaderKey::SIGNAL));
        }
        Ok(Headers {
            schema,
            fingerprint: get(HeaderKey::FINGERPRINT)?
                .ok_or(Error::MissingHeader(HeaderKey::FINGERPRINT))?
                .to_string(),
            producer: get(HeaderKey::PRODUCER)?.unwrap_or_default().to_string(),
            traceparent: get(HeaderKey::TRACEPARENT)?.map(str::to_string),
            policy_version,
            kind,
            signal,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let h = Headers::data(SchemaId::Rollouts, "rollout-2")
            .with_policy_version(17)
            .with_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
        assert_eq!(Headers::from_wire(&h.to_wire()).unwrap(), h);
        let s = Headers::signal(SchemaId::Policy, "trainer-0", Signal::PolicyVersion(3));
        assert_eq!(Headers::from_wire(&s.to_wire()).unwrap(), s);
        for sig in [
            Signal::EndOfData,
            Signal::EndOfRun,
            Signal::Barrier(9),
            Signal::PolicyVersion(0),
        ] {
            assert_eq!(sig.to_string().parse::<Signal>().unwrap(), sig);
        }
    }

    #[test]
    fn bad_headers_name_the_key() {
        let mut w = Headers::data(SchemaId::Samples, "mask-0").to_wire();
        w.push((HeaderKey::POLICY_VERSION.into(), b"seven".to_vec()));
        let e = Headers::from_wire(&w).unwrap_err().to_string();
        assert!(e.contains("streamrl-policy-version") && e.contains("seven"), "{e}");
        let e = Headers::from_wire(&[]).unwrap_err().to_string();
        assert!(e.contains("streamrl-schema"), "{e}");
        let e = Headers::from_wire(&[(HeaderKey::SCHEMA.into(), b"nope".to_vec())])
            .unwrap_err()
            .to_string();
        assert!(e.contains("nope"), "{e}");
    }
}
