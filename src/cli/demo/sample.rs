//! The sample: orders of a small shop over four weeks, from a seeded generator so the shape is
//! the same on every run, with [`POISON_EVENTS`] payments revenue_by_day cannot apply, three
//! producer bugs that fall into three error groups (`vantage dlq groups`): an amount with a
//! decimal comma (22P02), a B2B order too large for revenue_by_day's `numeric(14,2)` column
//! (22003: widening the column fixes it, and `dlq requeue --group` then applies them), and no
//! amount at all (23502). The order paid without an amount is refunded later, so its refund
//! waits behind the failing payment in revenue_by_day's lane: a blocked lane
//! (`vantage status --blocked`) until the payment is dead-lettered.

use std::collections::BTreeSet;

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::store::NewEvent;

/// How many `OrderPaid` events of the sample carry an amount revenue_by_day cannot apply.
pub const POISON_EVENTS: usize = 3;

/// The producer bugs behind the poison events, one each, in the order they appear.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Poison {
    /// `"12,05"`: written with a decimal comma (SQLSTATE 22P02).
    DecimalComma,
    /// `"12050000000000.00"`: a B2B order too large for `numeric(14,2)` (22003).
    TooLarge,
    /// No `amount` at all (23502); this order is refunded later, and its refund waits behind
    /// the failing payment.
    Missing,
}

/// The poison events' bugs, in sample order.
pub const POISONS: [Poison; POISON_EVENTS] =
    [Poison::DecimalComma, Poison::TooLarge, Poison::Missing];
/// The sample is the same on every run (its ids aside).
const SEED: u64 = 0x7661_6e74_6167_6521;

/// Every event type of the sample.
pub(super) const EVENT_TYPES: &[&str] = &[
    "OrderPlaced",
    "OrderPaid",
    "OrderShipped",
    "OrderDelivered",
    "OrderCancelled",
];
const CURRENCIES: &[(&str, u64)] = &[("EUR", 70), ("USD", 20), ("GBP", 10)];
const CARRIERS: &[&str] = &["DHL", "UPS", "GLS", "DPD", "PostNL"];
const PAYMENT_METHODS: &[&str] = &["card", "paypal", "bank_transfer"];

/// One order: its stream and events, in order.
pub(super) struct Order {
    pub(super) stream_id: Uuid,
    pub(super) events: Vec<NewEvent>,
    /// Index of the poison event in `events`, if this order has one.
    pub(super) poison_event: Option<usize>,
}

pub(super) struct Sample {
    pub(super) orders: Vec<Order>,
    /// Distinct customers who placed them.
    pub(super) customers: usize,
    pub(super) events: usize,
    /// The amount the decimal-comma poison event carries, for the explanation.
    pub(super) poison_example: String,
}

/// How an order ends.
enum Fate {
    CancelledUnpaid,
    Paid,
    Refunded,
    Shipped,
    Delivered,
}

impl Sample {
    /// `orders` orders of `customers` customers (a few buy often, most rarely), placed over four
    /// weeks ending a week before `now`, so every later event is in the past too. The shape is
    /// the same on every run; the ids are new. [`POISON_EVENTS`] orders, spread through the
    /// sample, are paid with an amount written with a decimal comma.
    pub(super) fn generate(orders: usize, customers: usize, now: DateTime<Utc>) -> Sample {
        let mut rng = Rng(SEED);
        let people: Vec<(Uuid, &str)> = (0..customers)
            .map(|_| (Uuid::new_v4(), rng.weighted(CURRENCIES)))
            .collect();
        let poison: Vec<usize> = (1..=POISON_EVENTS)
            .map(|k| k * orders / (POISON_EVENTS + 1))
            .collect();
        let mut used = BTreeSet::new();
        let mut events = 0;
        let mut poison_example = String::new();
        let mut sample = Vec::with_capacity(orders);
        let newest = now - chrono::Duration::days(7);

        for i in 0..orders {
            let order_id = Uuid::new_v4();
            let who = ((rng.unit().powi(2) * customers as f64) as usize).min(customers - 1);
            used.insert(who);
            let (customer_id, currency) = people[who];
            let items = 1 + rng.below(5);
            let total: u64 = (0..items).map(|_| rng.between(499, 12_999)).sum();
            let placed_at = newest - chrono::Duration::seconds(rng.below(28 * 86_400) as i64);
            let bug = poison.iter().position(|&p| p == i).map(|k| POISONS[k]);
            let is_poison = bug.is_some();
            let fate = if bug == Some(Poison::Missing) {
                Fate::Refunded
            } else if is_poison {
                Fate::Delivered
            } else {
                match rng.below(100) {
                    0..=7 => Fate::CancelledUnpaid,
                    8..=19 => Fate::Paid,
                    20..=24 => Fate::Refunded,
                    25..=49 => Fate::Shipped,
                    _ => Fate::Delivered,
                }
            };

            let mut order = Order {
                stream_id: order_id,
                events: Vec::with_capacity(4),
                poison_event: None,
            };
            order.events.push(event(
                "OrderPlaced",
                json!({
                    "order_id": order_id,
                    "customer_id": customer_id,
                    "items": items,
                    "total": money(total),
                    "currency": currency,
                    "placed_at": timestamp(placed_at),
                }),
            ));
            if let Fate::CancelledUnpaid = fate {
                let cancelled_at = placed_at + minutes(rng.between(30, 4_320));
                order.events.push(cancellation(
                    (order_id, customer_id, currency),
                    cancelled_at,
                    "payment not received",
                    None,
                ));
            } else {
                let paid_at = placed_at + minutes(rng.between(1, 120));
                if is_poison {
                    order.poison_event = Some(order.events.len());
                }
                let amount = match bug {
                    // A producer bug: the amount formatted for a German invoice.
                    Some(Poison::DecimalComma) => {
                        let text = money(total).replace('.', ",");
                        poison_example = text.clone();
                        Some(text)
                    }
                    // A B2B order of billions: more than revenue_by_day's column holds.
                    Some(Poison::TooLarge) => Some(format!("{total}0000000000.00")),
                    // And one that left it out.
                    Some(Poison::Missing) => None,
                    None => Some(money(total)),
                };
                let mut paid = json!({
                    "order_id": order_id,
                    "currency": currency,
                    "method": PAYMENT_METHODS[rng.below(PAYMENT_METHODS.len() as u64) as usize],
                    "paid_at": timestamp(paid_at),
                });
                if let Some(amount) = amount {
                    paid["amount"] = Value::String(amount);
                }
                order.events.push(event("OrderPaid", paid));
                match fate {
                    Fate::Refunded => {
                        let cancelled_at = paid_at + minutes(rng.between(60, 2_880));
                        order.events.push(cancellation(
                            (order_id, customer_id, currency),
                            cancelled_at,
                            "customer request",
                            Some(money(total)),
                        ));
                    }
                    Fate::Shipped | Fate::Delivered => {
                        let carrier = CARRIERS[rng.below(CARRIERS.len() as u64) as usize];
                        let shipped_at = paid_at + minutes(rng.between(120, 2_880));
                        order.events.push(event(
                            "OrderShipped",
                            json!({
                                "order_id": order_id,
                                "carrier": carrier,
                                "tracking_number": format!("{carrier}{:010}", rng.below(10_000_000_000)),
                                "shipped_at": timestamp(shipped_at),
                            }),
                        ));
                        if let Fate::Delivered = fate {
                            let delivered_at = shipped_at + minutes(rng.between(1_200, 5_760));
                            order.events.push(event(
                                "OrderDelivered",
                                json!({
                                    "order_id": order_id,
                                    "delivered_at": timestamp(delivered_at),
                                }),
                            ));
                        }
                    }
                    Fate::CancelledUnpaid | Fate::Paid => {}
                }
            }
            events += order.events.len();
            sample.push(order);
        }
        Sample {
            orders: sample,
            customers: used.len(),
            events,
            poison_example,
        }
    }
}

/// An event of the sample, with the metadata a real producer would add.
fn event(event_type: &str, data: Value) -> NewEvent {
    NewEvent {
        event_type: event_type.to_owned(),
        data,
        metadata: Some(json!({
            "producer": "vantage demo",
            "correlation_id": Uuid::new_v4(),
        })),
        event_id: None,
    }
}

/// An `OrderCancelled` event of `(order, customer, currency)`; `refund_amount` only when the
/// order had been paid.
fn cancellation(
    (order_id, customer_id, currency): (Uuid, Uuid, &str),
    at: DateTime<Utc>,
    reason: &str,
    refund_amount: Option<String>,
) -> NewEvent {
    let mut data = json!({
        "order_id": order_id,
        "customer_id": customer_id,
        "currency": currency,
        "cancelled_at": timestamp(at),
        "reason": reason,
    });
    if let Some(amount) = refund_amount {
        data["refund_amount"] = Value::String(amount);
    }
    event("OrderCancelled", data)
}

fn money(cents: u64) -> String {
    format!("{}.{:02}", cents / 100, cents % 100)
}

pub(super) fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Secs, true)
}

fn minutes(n: u64) -> chrono::Duration {
    chrono::Duration::minutes(n as i64)
}

/// SplitMix64: a small, seedable generator, so the sample has the same shape on every run.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`; the modulo bias is negligible for these sizes).
    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn weighted<'a>(&mut self, choices: &[(&'a str, u64)]) -> &'a str {
        let total: u64 = choices.iter().map(|(_, w)| w).sum();
        let mut pick = self.below(total);
        for (choice, weight) in choices {
            if pick < *weight {
                return choice;
            }
            pick -= weight;
        }
        choices[0].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sample_has_the_promised_shape() {
        let s = Sample::generate(2000, 500, Utc::now());
        assert_eq!(s.orders.len(), 2000);
        assert!(s.customers > 300 && s.customers <= 500, "{}", s.customers);
        assert!(s.orders.iter().all(|o| (2..=4).contains(&o.events.len())));
        assert_eq!(
            s.events,
            s.orders.iter().map(|o| o.events.len()).sum::<usize>()
        );
        let poison: Vec<&NewEvent> = s
            .orders
            .iter()
            .filter_map(|o| o.poison_event.map(|i| &o.events[i]))
            .collect();
        assert_eq!(poison.len(), POISON_EVENTS);
        let amounts: Vec<Option<&str>> = poison
            .iter()
            .map(|e| {
                assert_eq!(e.event_type, "OrderPaid");
                e.data.get("amount").and_then(Value::as_str)
            })
            .collect();
        assert!(amounts[0].unwrap().contains(','), "{amounts:?}");
        assert!(amounts[1].unwrap().len() > 15, "{amounts:?}");
        assert_eq!(amounts[2], None);
        // The order paid without an amount is refunded: its refund comes after the payment.
        let missing = s
            .orders
            .iter()
            .find(|o| {
                o.poison_event
                    .is_some_and(|i| o.events[i].data.get("amount").is_none())
            })
            .unwrap();
        let after: Vec<&str> = missing.events[missing.poison_event.unwrap() + 1..]
            .iter()
            .map(|e| e.event_type.as_str())
            .collect();
        assert_eq!(after, ["OrderCancelled"]);
        // Every healthy amount parses; all timestamps are in the past.
        let now = timestamp(Utc::now());
        for o in &s.orders {
            for (i, e) in o.events.iter().enumerate() {
                if o.poison_event != Some(i) {
                    if let Some(amount) = e.data.get("amount") {
                        amount.as_str().unwrap().parse::<f64>().unwrap();
                    }
                }
                for (key, value) in e.data.as_object().unwrap() {
                    if key.ends_with("_at") {
                        assert!(value.as_str().unwrap() < now.as_str(), "{key} {value}");
                    }
                }
            }
        }
        // The same shape on every run.
        let again = Sample::generate(2000, 500, Utc::now());
        assert_eq!(again.events, s.events);
    }

    #[test]
    fn money_has_two_decimals() {
        assert_eq!(money(1205), "12.05");
        assert_eq!(money(7), "0.07");
    }
}
