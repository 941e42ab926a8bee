-- The read model of `vantage demo` (SPEC §6): the tables the perspectives of config/demo.toml
-- write. `vantage demo` runs this file (built into the binary) before it starts the daemon.
-- Idempotent, so the demo can run again on the same database.

CREATE SCHEMA IF NOT EXISTS demo;

-- order_summary: one row per order, in the state of its last event.
CREATE TABLE IF NOT EXISTS demo.order_summary (
    order_id     uuid PRIMARY KEY,
    customer_id  uuid NOT NULL,
    status       text NOT NULL,
    items        int NOT NULL,
    total        numeric(12,2) NOT NULL,
    currency     text NOT NULL,
    placed_at    timestamptz NOT NULL,
    paid_at      timestamptz,
    shipped_at   timestamptz,
    carrier      text,
    delivered_at timestamptz,
    cancelled_at timestamptz,
    last_version int NOT NULL
);

-- revenue_by_day: payments and refunds per day and currency.
CREATE TABLE IF NOT EXISTS demo.revenue_by_day (
    day      date NOT NULL,
    currency text NOT NULL,
    orders   int NOT NULL DEFAULT 0,
    revenue  numeric(14,2) NOT NULL DEFAULT 0,
    refunds  numeric(14,2) NOT NULL DEFAULT 0,
    PRIMARY KEY (day, currency)
);

-- customer_orders: orders per customer.
CREATE TABLE IF NOT EXISTS demo.customer_orders (
    customer_id    uuid PRIMARY KEY,
    orders         int NOT NULL,
    cancelled      int NOT NULL DEFAULT 0,
    first_order_at timestamptz NOT NULL,
    last_order_at  timestamptz NOT NULL
);
