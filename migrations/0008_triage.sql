-- vantage baseline, part 8 of 9: triage.
--
-- Error fingerprints group open dead letters (`vantage dlq groups`, `--group` on requeue and
-- purge) by perspective, event type, SQLSTATE (as the daemon writes it: "... (SQLSTATE 22P02)")
-- and the error text with its variable parts masked (numbers, uuids, quoted values, hex, the
-- values of a key), through the open-fingerprint index, so millions of dead letters are never
-- loaded anywhere. Pausing (and the automatic quarantine) is a fenced UPDATE of the
-- perspective's registry row (paused_at IS NULL), issued by the store; claims skip a paused
-- perspective (part 4).

-- The error that caused it: a dead letter's text is "<why it was moved>\nlast error: <the
-- handler's error>"; the handler's error is what groups.
CREATE FUNCTION wh_error_cause(p_error text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN strpos(p_error, 'last error: ') > 0
                THEN substring(p_error from '.*last error: (.*)$')
                ELSE p_error END;
$$;

-- The SQLSTATE the daemon recorded with the error, NULL when none.
CREATE FUNCTION wh_error_sqlstate(p_error text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $$
    SELECT substring(wh_error_cause(p_error) from '\(SQLSTATE ([0-9A-Z]{5})\)');
$$;

-- The cause with its variable parts masked, whitespace collapsed, at most 500 characters.
-- In this order (inner first):
--   1. the SQLSTATE suffix goes (it is a component of its own); a key's values "=(...)" -> "=(?)";
--   2. an identifier named as such (relation "x", column "x", constraint "x", ...) is protected,
--      so the message still says which table or constraint;
--   3. other double-quoted and single-quoted values -> "?" and '?';
--   4. uuids -> <uuid>; 5. 0x... and runs of 8+ hex digits with a digit in them -> <hex>;
--   6. numbers (whole words: "v2" and "order_2024" stay) -> <n>; then the protection is undone.
CREATE FUNCTION wh_error_mask(p_error text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $$
    SELECT left(btrim(translate(regexp_replace(
        regexp_replace(
          regexp_replace(regexp_replace(
            regexp_replace(
              regexp_replace(regexp_replace(
                regexp_replace(
                  regexp_replace(regexp_replace(wh_error_cause(p_error),
                      '\s*\(SQLSTATE [0-9A-Z]{5}\)', '', 'g'),
                    '\)=\([^)]*\)', ')=(?)', 'g'),
                  '(\m(?:relation|column|constraint|table|function|type|schema|index|sequence|view|trigger|domain|database|role|operator|extension)) "([^"]*)"',
                  '\1 ' || chr(1) || '\2' || chr(2), 'gi'),
                '"[^"]*"', '"?"', 'g'),
              '''[^'']*''', '''?''', 'g'),
            '[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}',
            '<uuid>', 'g'),
            '\m0x[0-9a-fA-F]+\M', '<hex>', 'g'),
          '\m(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*[0-9])[0-9a-fA-F]{8,}\M', '<hex>', 'g'),
        '\m[0-9]+(\.[0-9]+)?\M', '<n>', 'g'),
      '\s+', ' ', 'g'), chr(1) || chr(2), '""')), 500);
$$;

-- The fingerprint: 12 hex digits of md5 over (perspective, event type, SQLSTATE, masked text).
CREATE FUNCTION wh_error_fingerprint(p_perspective text, p_event_type text, p_error text)
 RETURNS text
 LANGUAGE sql
 IMMUTABLE PARALLEL SAFE
AS $$
    SELECT left(md5(concat_ws(chr(31), p_perspective, coalesce(p_event_type, ''),
                              coalesce(wh_error_sqlstate(p_error), ''),
                              coalesce(wh_error_mask(p_error), ''))), 12);
$$;
