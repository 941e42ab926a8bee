//! Typed perspectives: the payload is deserialized with serde before the handler sees it.
//!
//! A [`TypedPerspective`] declares its event type (`type Event`, usually an enum with one
//! variant per event type it subscribes to) and receives a [`TypedEnvelope`] instead of raw
//! JSON. [`Typed`] turns it into a [`Perspective`] for
//! [`DaemonBuilder::perspective`](crate::daemon::DaemonBuilder::perspective).
//!
//! A payload that does not deserialize can never be applied: it is an
//! [`ApplyError::Permanent`], dead-lettered at once with reason `PermanentFailure`, whose error
//! text names the event type and carries serde's error (with the path of the offending field).
//! How a payload maps onto `Event` is described at [`decode_event`].

use async_trait::async_trait;
use serde::de::{self, DeserializeOwned, DeserializeSeed, Visitor};
use serde::Deserializer;
use uuid::Uuid;

use super::handler::{ApplyError, ApplyTx, EventEnvelope, Perspective};

/// One event with its payload deserialized, as a [`TypedPerspective`] sees it. The fields
/// are those of [`EventEnvelope`], with `data` of the perspective's event type.
#[derive(Clone, Debug, PartialEq)]
pub struct TypedEnvelope<E> {
    /// The work row (one per event and perspective); the cooldown key.
    pub event_work_id: Uuid,
    /// The perspective this delivery is for.
    pub perspective_name: String,
    /// The event's id.
    pub event_id: Uuid,
    /// The stream (aggregate) the event belongs to: a perspective gets the events of one
    /// stream one at a time, in `stream_version` order.
    pub stream_id: Uuid,
    /// Its version within the stream.
    pub stream_version: i32,
    /// Its position in the whole store.
    pub global_position: i64,
    /// Its type, as stored.
    pub event_type: String,
    /// The payload, deserialized.
    pub data: E,
    /// Metadata (an empty object when none).
    pub metadata: serde_json::Value,
    /// How many times the row has been claimed (this delivery included).
    pub attempts: i32,
    /// How many apply failures were recorded before this delivery.
    pub failures: i32,
    /// Whether this delivery replays history the perspective already had (a rebuild's
    /// catch-up): skip side effects outside the database when it is true. See
    /// [`EventEnvelope::replay`].
    pub replay: bool,
}

impl<E: DeserializeOwned> TypedEnvelope<E> {
    /// Deserializes the envelope's payload (see [`decode_event`] for how it maps onto `E`). A payload that does not deserialize is an [`ApplyError::Permanent`] with the
    /// [`PayloadError`]'s text.
    ///
    /// ```
    /// # use vantage::perspective::{ApplyError, EventEnvelope, TypedEnvelope};
    /// #[derive(Debug, serde::Deserialize)]
    /// enum Ev { Renamed { name: String } }
    ///
    /// let raw = EventEnvelope {
    ///     event_work_id: uuid::Uuid::new_v4(),
    ///     perspective_name: "names".into(),
    ///     event_id: uuid::Uuid::new_v4(),
    ///     stream_id: uuid::Uuid::new_v4(),
    ///     stream_version: 1,
    ///     global_position: 1,
    ///     event_type: "Renamed".into(),
    ///     data: serde_json::json!({}),
    ///     metadata: serde_json::json!({}),
    ///     attempts: 1,
    ///     failures: 0,
    ///     replay: false,
    /// };
    /// let err = TypedEnvelope::<Ev>::decode(&raw).unwrap_err();
    /// assert_eq!(
    ///     err,
    ///     ApplyError::Permanent("payload of Renamed does not deserialize: missing field `name`".into())
    /// );
    /// ```
    pub fn decode(envelope: &EventEnvelope) -> Result<TypedEnvelope<E>, ApplyError> {
        let data = decode_event(&envelope.event_type, &envelope.data)
            .map_err(|e| ApplyError::Permanent(e.to_string()))?;
        Ok(TypedEnvelope {
            event_work_id: envelope.event_work_id,
            perspective_name: envelope.perspective_name.clone(),
            event_id: envelope.event_id,
            stream_id: envelope.stream_id,
            stream_version: envelope.stream_version,
            global_position: envelope.global_position,
            event_type: envelope.event_type.clone(),
            data,
            metadata: envelope.metadata.clone(),
            attempts: envelope.attempts,
            failures: envelope.failures,
            replay: envelope.replay,
        })
    }
}

/// A payload that does not deserialize as a perspective's event type. Its text is
/// `payload of <event type> does not deserialize: [<field path>: ]<serde's error>`.
#[derive(Debug, thiserror::Error)]
#[error("payload of {event_type} does not deserialize: {}{error}", path_prefix(.path))]
pub struct PayloadError {
    event_type: String,
    path: String,
    error: serde_json::Error,
}

fn path_prefix(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!("{path}: ")
    }
}

impl PayloadError {
    fn new(event_type: &str, error: serde_path_to_error::Error<serde_json::Error>) -> Self {
        use serde_path_to_error::Segment;
        let mut path = String::new();
        // The enum's variant is the event type, already in the message: leave it out.
        let segments = error
            .path()
            .iter()
            .skip_while(|s| matches!(s, Segment::Enum { .. }));
        for segment in segments {
            match segment {
                Segment::Seq { index } => path.push_str(&format!("[{index}]")),
                Segment::Map { key } | Segment::Enum { variant: key } => {
                    if !path.is_empty() {
                        path.push('.');
                    }
                    path.push_str(key);
                }
                Segment::Unknown => {
                    if !path.is_empty() {
                        path.push('.');
                    }
                    path.push('?');
                }
            }
        }
        PayloadError {
            event_type: event_type.to_string(),
            path,
            error: error.into_inner(),
        }
    }

    /// The type of the event whose payload was refused.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }

    /// Where in the payload serde gave up (`lines[2].sku`; empty for the payload itself).
    pub fn path(&self) -> &str {
        &self.path
    }
}

/// Deserializes an event's payload as `E`, the way [`Typed`] does before calling
/// [`TypedPerspective::apply`]. Useful to test that stored payloads still decode.
///
/// # How the payload maps onto `Event`
///
/// - An **enum** (serde's default, externally tagged representation) is selected by the
///   event's type: variant `ItemReceived` ↔ event type `"ItemReceived"` (use
///   `#[serde(rename = "…")]` for other spellings), and the variant's fields are read from the
///   payload. A unit variant ignores the payload, so `#[serde(other)] Other` catches every type
///   the enum does not name. A type with no variant and no `#[serde(other)]` is a permanent
///   failure (`unknown variant`).
/// - Anything else (a struct, a map, `serde_json::Value`) is read from the payload as is,
///   whatever the event type.
///
/// ```
/// use serde::Deserialize;
/// use vantage::perspective::decode_event;
///
/// #[derive(Debug, PartialEq, Deserialize)]
/// enum Inventory {
///     ItemReceived { sku: String, quantity: u32 },
///     Audited,
/// }
///
/// let data = serde_json::json!({ "sku": "A-1", "quantity": 3 });
/// let event: Inventory = decode_event("ItemReceived", &data).unwrap();
/// assert_eq!(event, Inventory::ItemReceived { sku: "A-1".into(), quantity: 3 });
///
/// // A unit variant ignores the payload.
/// let event: Inventory = decode_event("Audited", &serde_json::json!({ "by": "ops" })).unwrap();
/// assert_eq!(event, Inventory::Audited);
///
/// // The error names the event type and the field.
/// let bad = serde_json::json!({ "sku": "A-1", "quantity": "three" });
/// let err = decode_event::<Inventory>("ItemReceived", &bad).unwrap_err();
/// assert_eq!(
///     err.to_string(),
///     "payload of ItemReceived does not deserialize: quantity: \
///      invalid type: string \"three\", expected u32"
/// );
/// ```
pub fn decode_event<E: DeserializeOwned>(
    event_type: &str,
    data: &serde_json::Value,
) -> Result<E, PayloadError> {
    serde_path_to_error::deserialize(EventDeserializer { event_type, data })
        .map_err(|error| PayloadError::new(event_type, error))
}

/// A read model whose events arrive deserialized as [`TypedPerspective::Event`]. Run it with
/// [`Typed`], which implements [`Perspective`] for it.
///
/// ```no_run
/// use async_trait::async_trait;
/// use serde::Deserialize;
/// use vantage::perspective::{ApplyError, ApplyTx, Typed, TypedEnvelope, TypedPerspective};
///
/// #[derive(Deserialize)]
/// enum NameEvent {
///     Renamed { name: String },
/// }
///
/// struct Names;
///
/// #[async_trait]
/// impl TypedPerspective for Names {
///     type Event = NameEvent;
///
///     fn name(&self) -> &str {
///         "names"
///     }
///
///     fn event_types(&self) -> Vec<String> {
///         vec!["Renamed".into()]
///     }
///
///     async fn apply(
///         &self,
///         event: &TypedEnvelope<NameEvent>,
///         tx: &mut ApplyTx<'_>,
///     ) -> Result<(), ApplyError> {
///         let NameEvent::Renamed { name } = &event.data;
///         sqlx::query("INSERT INTO names (stream_id, name) VALUES ($1, $2) \
///                      ON CONFLICT (stream_id) DO UPDATE SET name = EXCLUDED.name")
///             .bind(event.stream_id)
///             .bind(name)
///             .execute(tx.connection()?)
///             .await
///             .map_err(ApplyError::from_sqlx)?;
///         Ok(())
///     }
/// }
///
/// # async fn run(settings: vantage::config::Settings) -> Result<(), vantage::daemon::DaemonError> {
/// let daemon = vantage::daemon::DaemonBuilder::new(settings)
///     .perspective(Typed(Names))
///     .start()
///     .await?;
/// # daemon.shutdown().await
/// # }
/// ```
#[async_trait]
pub trait TypedPerspective: Send + Sync + 'static {
    /// The payload type (see [`decode_event`] for how a payload maps onto it).
    type Event: DeserializeOwned + Send + Sync;

    /// Unique name (`wh_perspectives.perspective_name`).
    fn name(&self) -> &str;

    /// Event types this perspective subscribes to (`"*"` = every type).
    fn event_types(&self) -> Vec<String>;

    /// Applies one event, in stream order. Effects written through `tx` commit together with
    /// the completion of the event's work row (exactly once); effects outside the database
    /// belong in the `!event.replay` case ([`TypedEnvelope::replay`]).
    async fn apply(
        &self,
        event: &TypedEnvelope<Self::Event>,
        tx: &mut ApplyTx<'_>,
    ) -> Result<(), ApplyError>;

    /// Clears the read model before a rebuild (`vantage perspectives rebuild`). Default: nothing.
    async fn reset(&self, _tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        Ok(())
    }

    /// Whether every effect of `apply` goes through `tx` (true by default); see
    /// [`Perspective::effects_in_transaction`].
    fn effects_in_transaction(&self) -> bool {
        true
    }
}

/// Runs a [`TypedPerspective`] as a [`Perspective`]: deserializes each payload (a failure is
/// [`ApplyError::Permanent`], before the handler runs), then calls
/// [`TypedPerspective::apply`] with the transaction as an [`ApplyTx`].
#[derive(Clone, Debug, Default)]
pub struct Typed<P>(pub P);

#[async_trait]
impl<P: TypedPerspective> Perspective for Typed<P> {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn event_types(&self) -> Vec<String> {
        self.0.event_types()
    }

    async fn apply(&self, event: &EventEnvelope, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        let typed = TypedEnvelope::<P::Event>::decode(event)?;
        self.0.apply(&typed, tx).await
    }

    async fn reset(&self, tx: &mut ApplyTx<'_>) -> Result<(), ApplyError> {
        self.0.reset(tx).await
    }

    fn effects_in_transaction(&self) -> bool {
        self.0.effects_in_transaction()
    }
}

/// Deserializes an event: `deserialize_enum` selects the variant by the event type (a unit
/// variant ignores the payload); every other request is answered by the payload itself.
struct EventDeserializer<'de> {
    event_type: &'de str,
    data: &'de serde_json::Value,
}

impl<'de> Deserializer<'de> for EventDeserializer<'de> {
    type Error = serde_json::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.data.deserialize_any(visitor)
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Self::Error> {
        self.data.deserialize_option(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.data.deserialize_newtype_struct(name, visitor)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.data.deserialize_struct(name, fields, visitor)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        visitor.visit_enum(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct seq tuple tuple_struct map identifier ignored_any
    }
}

impl<'de> de::EnumAccess<'de> for EventDeserializer<'de> {
    type Error = serde_json::Error;
    type Variant = Payload<'de>;

    fn variant_seed<V: DeserializeSeed<'de>>(
        self,
        seed: V,
    ) -> Result<(V::Value, Self::Variant), Self::Error> {
        let tag = de::value::BorrowedStrDeserializer::<serde_json::Error>::new(self.event_type);
        let variant = seed.deserialize(tag)?;
        Ok((variant, Payload(self.data)))
    }
}

/// The payload, as the content of the variant the event type selected.
struct Payload<'de>(&'de serde_json::Value);

impl<'de> de::VariantAccess<'de> for Payload<'de> {
    type Error = serde_json::Error;

    fn unit_variant(self) -> Result<(), Self::Error> {
        Ok(())
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(
        self,
        seed: T,
    ) -> Result<T::Value, Self::Error> {
        seed.deserialize(self.0)
    }

    fn tuple_variant<V: Visitor<'de>>(
        self,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_tuple(len, visitor)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Self::Error> {
        self.0.deserialize_struct("", fields, visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perspective::NO_TRANSACTION;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Debug, PartialEq, Deserialize)]
    enum Ev {
        Received {
            sku: String,
            quantity: u32,
        },
        #[serde(rename = "item.shipped")]
        Shipped(Shipment),
        Moved(String, String),
        #[serde(other)]
        Other,
    }

    #[derive(Debug, PartialEq, Deserialize)]
    struct Shipment {
        sku: String,
        quantity: u32,
    }

    #[test]
    fn an_enum_is_selected_by_the_event_type() {
        let got: Ev = decode_event("Received", &json!({"sku": "A", "quantity": 2})).unwrap();
        assert_eq!(
            got,
            Ev::Received {
                sku: "A".into(),
                quantity: 2
            }
        );
        let got: Ev = decode_event("item.shipped", &json!({"sku": "B", "quantity": 1})).unwrap();
        assert_eq!(
            got,
            Ev::Shipped(Shipment {
                sku: "B".into(),
                quantity: 1
            })
        );
        let got: Ev = decode_event("Moved", &json!(["here", "there"])).unwrap();
        assert_eq!(got, Ev::Moved("here".into(), "there".into()));
    }

    #[test]
    fn serde_other_catches_the_types_the_enum_does_not_name() {
        let got: Ev = decode_event("Whatever", &json!({"x": 1})).unwrap();
        assert_eq!(got, Ev::Other);
    }

    #[test]
    fn an_unknown_type_without_a_catch_all_is_refused_with_the_type_named() {
        #[derive(Debug, Deserialize)]
        enum Strict {
            #[allow(dead_code)]
            Only {},
        }
        let err = decode_event::<Strict>("Nope", &json!({})).unwrap_err();
        assert_eq!(err.event_type(), "Nope");
        assert!(
            err.to_string().starts_with(
                "payload of Nope does not deserialize: unknown variant `Nope`, expected `Only`"
            ),
            "{err}"
        );
    }

    #[test]
    fn a_struct_is_read_from_the_payload_whatever_the_type() {
        let got: Shipment = decode_event("Anything", &json!({"sku": "C", "quantity": 5})).unwrap();
        assert_eq!(
            got,
            Shipment {
                sku: "C".into(),
                quantity: 5
            }
        );
        let got: serde_json::Value = decode_event("Anything", &json!({"a": [1]})).unwrap();
        assert_eq!(got, json!({"a": [1]}));
    }

    #[test]
    fn the_error_gives_the_path_of_the_offending_field() {
        #[derive(Debug, Deserialize)]
        #[allow(dead_code)]
        enum Order {
            Placed { lines: Vec<Shipment> },
        }
        let data = json!({"lines": [{"sku": "A", "quantity": 1}, {"sku": "B", "quantity": -1}]});
        let err = decode_event::<Order>("Placed", &data).unwrap_err();
        assert_eq!(err.path(), "lines[1].quantity");
        assert_eq!(
            err.to_string(),
            "payload of Placed does not deserialize: lines[1].quantity: \
             invalid value: integer `-1`, expected u32"
        );
    }

    #[test]
    fn no_transaction_is_a_clear_permanent_error() {
        let mut tx = ApplyTx::none();
        assert!(!tx.has_database());
        assert_eq!(
            tx.connection().unwrap_err(),
            ApplyError::Permanent(NO_TRANSACTION.into())
        );
    }
}
