"""Access rules as pure logic: tokens, origins, client addresses, rates (explicit times), stream limits."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamsvc.door.access import (
    FD_RESERVE,
    MAX_CONNECTIONS_CEILING,
    AccessConfig,
    ConnectionLimits,
    LogGate,
    ProtocolErrors,
    RATE_PRUNE_PERIOD_S,
    RATE_TABLE_SIZE,
    Rate,
    RateKind,
    Refusal,
    RequestRates,
    StreamLimits,
    TokenBucket,
    address_key,
    bearer_token,
    client_address,
    default_max_connections,
    exposure_warning,
    find_token,
    normalize_origin,
    origin_allowed,
    parse_auth_file,
)

tokens_alphabet = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
tokens = st.text(tokens_alphabet, min_size=1, max_size=40)


# ---------------------------------------------------------------- tokens


def test_auth_file_lines_give_tokens_and_their_stream_limits():
    text = "# viewers\nalice-123 2\n\n  bob   # no limit\ncarol 10  # a comment\n"
    assert parse_auth_file(text) == {"alice-123": 2, "bob": None, "carol": 10}


@pytest.mark.parametrize("line, fault", [
    ("alice 0", "MAX_STREAMS"), ("alice two", "MAX_STREAMS"), ("alice 1 2", "MAX_STREAMS"),
    ("alice -1", "MAX_STREAMS"), ("al\u00e9 1", "printable ASCII"),
])
def test_a_bad_auth_file_line_is_an_error_naming_the_line(line, fault):
    with pytest.raises(ValueError, match=rf"tokens.txt, line 2: .*{fault}"):
        parse_auth_file(f"ok\n{line}\n", source="tokens.txt")


def test_a_token_twice_in_the_auth_file_is_an_error():
    with pytest.raises(ValueError, match="line 3: the token appears twice"):
        parse_auth_file("a\nb\na 2\n")


def test_find_token_matches_only_the_exact_token():
    table = {"s3cret": None, "other": 1}
    assert find_token(table, "s3cret") == "s3cret" and find_token(table, "other") == "other"
    for guess in (None, "", "s3cre", "s3cret ", "S3CRET", "s3cret2", "x"):
        assert find_token(table, guess) is None, guess


@settings(max_examples=200, deadline=None)
@given(st.lists(tokens, max_size=5, unique=True), tokens)
def test_find_token_agrees_with_plain_lookup(configured, guess):
    table = dict.fromkeys(configured)
    assert find_token(table, guess) == (guess if guess in table else None)


@pytest.mark.parametrize("header, token", [
    ("Bearer abc", "abc"), ("bearer abc", "abc"), ("  Bearer   abc  ", "abc"), ("Basic abc", None),
    ("Bearer", None), ("Bearer ", None), ("", None), (None, None), ("abc", None),
])
def test_bearer_token(header, token):
    assert bearer_token(header) == token


# ---------------------------------------------------------------- origins, addresses, exposure


@pytest.mark.parametrize("origin, host, allowed, ok", [
    (None, "example.org:8000", (), True),  # not a browser
    ("http://example.org:8000", "example.org:8000", (), True),  # the server's own page
    ("https://example.org", "example.org", (), True),  # behind a TLS proxy that keeps Host
    ("https://example.org", "example.org:443", (), True),
    ("HTTP://Example.ORG:8000", "example.org:8000", (), True),
    ("http://[::1]:8000", "[::1]:8000", (), True),
    ("http://evil.example", "example.org:8000", (), False),
    ("http://example.org:8001", "example.org:8000", (), False),  # another port is another origin
    ("http://example.org.evil.example:8000", "example.org:8000", (), False),
    ("null", "example.org:8000", (), False),  # a sandboxed frame or a file: page
    ("http://evil.example", None, (), False),
    ("https://app.example.org", "api.example.org", ("https://app.example.org",), True),
    ("https://app.example.org", "api.example.org", ("https://app.example.org:443/",), True),
    ("http://app.example.org", "api.example.org", ("https://app.example.org",), False),  # scheme counts
])
def test_origin_allowed(origin, host, allowed, ok):
    assert origin_allowed(origin, host, allowed) is ok


@pytest.mark.parametrize("origin", ["example.org", "ftp://example.org", "https://", "https://a.org/page", "null"])
def test_an_allowed_origin_must_be_scheme_host_port(origin):
    assert normalize_origin(origin) is None
    with pytest.raises(ValueError, match="scheme://host"):
        AccessConfig(allowed_origins=(origin,))


def test_client_address_takes_x_forwarded_for_only_behind_a_trusted_proxy():
    assert client_address("10.0.0.1", "203.0.113.7", trust_proxy=False) == "10.0.0.1"
    assert client_address("10.0.0.1", "203.0.113.7", trust_proxy=True) == "203.0.113.7"
    # the proxy appends the address it saw: earlier entries are the client's own claims
    assert client_address("10.0.0.1", "1.2.3.4, 203.0.113.7", trust_proxy=True) == "203.0.113.7"
    assert client_address("10.0.0.1", None, trust_proxy=True) == "10.0.0.1"
    assert client_address("10.0.0.1", " , ", trust_proxy=True) == "10.0.0.1"


@pytest.mark.parametrize("host, warns", [
    ("127.0.0.1", False), ("127.0.0.2", False), ("::1", False), ("localhost", False),
    ("0.0.0.0", True), ("::", True), ("192.168.1.5", True), ("example.org", True),
])
def test_serving_beyond_loopback_without_tokens_warns(host, warns):
    assert (exposure_warning(host, AccessConfig()) is not None) is warns
    assert exposure_warning(host, AccessConfig(tokens={"t": None})) is None


# ---------------------------------------------------------------- rates and limits


def test_token_bucket_allows_a_burst_then_the_rate():
    bucket = TokenBucket(Rate(per_s=2.0, burst=3), now=100.0)
    assert [bucket.take(100.0) for _ in range(5)] == [True, True, True, False, False]
    assert bucket.take(100.4) is False  # 0.8 of a message refilled
    assert bucket.take(100.5) is True  # 1.0
    assert bucket.take(100.5) is False
    assert [bucket.take(200.0) for _ in range(4)] == [True, True, True, False]  # refills to the burst, no more


def test_token_bucket_ignores_a_clock_going_back():
    bucket = TokenBucket(Rate(per_s=1.0, burst=1), now=10.0)
    assert bucket.take(10.0) and not bucket.take(5.0) and not bucket.take(10.5) and bucket.take(11.0)


@settings(max_examples=100, deadline=None)
@given(st.floats(0.1, 50), st.integers(1, 20), st.lists(st.floats(0, 0.5), min_size=1, max_size=200))
def test_token_bucket_never_grants_more_than_burst_plus_rate_times_time(per_s, burst, gaps):
    bucket, now, granted = TokenBucket(Rate(per_s, burst), 0.0), 0.0, 0
    for gap in gaps:
        now += gap
        granted += bucket.take(now)
    assert granted <= burst + per_s * now + 1e-6


def test_rate_must_be_positive():
    for per_s, burst in ((0, 1), (-1, 1), (float("inf"), 1), (1, 0)):
        with pytest.raises(ValueError, match="rate"):
            Rate(per_s, burst)


def test_stream_limits_per_token_and_per_address():
    limits = StreamLimits(AccessConfig(tokens={"a": 2, "b": None}, max_streams_per_client=3))
    assert limits.acquire("a", "10.0.0.1") is None
    assert limits.acquire("a", "10.0.0.2") is None
    reason, message = limits.acquire("a", "10.0.0.3")
    assert reason is Refusal.TOKEN_STREAMS and "2 streams" in message
    assert limits.acquire("b", "10.0.0.1") is None
    assert limits.acquire("b", "10.0.0.1") is None
    reason, message = limits.acquire("b", "10.0.0.1")
    assert reason is Refusal.CLIENT_STREAMS and "3 streams" in message
    limits.release("a", "10.0.0.1")
    assert limits.acquire("a", "10.0.0.1") is None  # a slot of both came free


def test_without_limits_any_number_of_streams_opens():
    limits = StreamLimits(AccessConfig())
    assert all(limits.acquire(None, "127.0.0.1") is None for _ in range(100))


@pytest.mark.parametrize("kwargs", [
    {"tokens": {"a b": None}}, {"tokens": {"a": 0}}, {"max_streams_per_client": 0},
    {"max_connections_per_client": 0}, {"max_connections": 0}, {"start_timeout_s": 0}, {"start_timeout_s": float("inf")},
    {"max_protocol_errors": 0},
])
def test_access_config_checks_its_values(kwargs):
    with pytest.raises(ValueError):
        AccessConfig(**kwargs)


# ---------------------------------------------------------------- what one address may hold and cost


def test_token_bucket_says_how_long_until_its_next_message():
    bucket = TokenBucket(Rate(per_s=4.0, burst=2), now=0.0)
    assert bucket.take(0.0) and bucket.wait_s() == 0.0
    assert bucket.take(0.0) and bucket.wait_s() == pytest.approx(0.25)
    assert not bucket.take(0.1) and bucket.wait_s() == pytest.approx(0.15)
    assert not bucket.full(0.4) and bucket.full(0.5)


def test_connection_limits_per_address_and_in_total_release_and_drop_entries():
    limits = ConnectionLimits(per_client=2, total=3)
    assert limits.acquire("10.0.0.1") is None and limits.acquire("10.0.0.1") is None
    reason, message = limits.acquire("10.0.0.1")
    assert reason is Refusal.CLIENT_CONNECTIONS and "2 connections" in message and "--max-connections-per-client" in message
    assert limits.acquire("10.0.0.2") is None
    reason, message = limits.acquire("10.0.0.3")  # the total first, whoever asks
    assert reason is Refusal.CONNECTIONS and "3 connections" in message and "--max-connections" in message
    assert (limits.held(), limits.held("10.0.0.1"), limits.held("10.0.0.3"), limits.addresses()) == (3, 2, 0, 2)
    limits.release("10.0.0.1")
    assert limits.acquire("10.0.0.3") is None  # a slot came free
    for address in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        limits.release(address)
    assert (limits.held(), limits.addresses()) == (0, 0)  # nothing kept for addresses that hold nothing
    with pytest.raises(ValueError, match="not acquired"):
        limits.release("10.0.0.1")


def test_refused_connections_leave_no_entry():
    limits = ConnectionLimits(per_client=1, total=1)
    assert limits.acquire("10.0.0.1") is None
    for i in range(1000):
        assert limits.acquire(f"10.1.{i // 256}.{i % 256}") is not None
    assert limits.addresses() == 1


def test_an_ipv6_host_counts_as_its_slash_64():
    assert address_key("2001:db8::1") == address_key("2001:db8::ffff:1") == "2001:db8::/64"
    assert address_key("2001:db8:0:1::1") != address_key("2001:db8::1")
    assert address_key("::ffff:10.0.0.1") == "10.0.0.1" and address_key("127.0.0.2") == "127.0.0.2"
    assert address_key("x" * 1000) == "x" * 64 and address_key("unknown") == "unknown"
    limits = ConnectionLimits(per_client=1, total=10)
    assert limits.acquire("2001:db8::1") is None
    assert limits.acquire("2001:db8::2")[0] is Refusal.CLIENT_CONNECTIONS


@pytest.mark.parametrize("fd_limit, cap", [
    (1024, (1024 - FD_RESERVE) // 3), (256, (256 - FD_RESERVE) // 3), (100, 1), (1 << 20, MAX_CONNECTIONS_CEILING),
    (-1, MAX_CONNECTIONS_CEILING),
])
def test_default_max_connections_leaves_room_below_the_fd_limit(fd_limit, cap):
    assert default_max_connections(fd_limit) == cap


def test_default_caps_let_one_address_open_the_load_tests_connections_and_leave_room_under_1024_fds():
    config = AccessConfig()
    assert config.max_connections_per_client >= 100 and config.connect_rate.burst >= 100
    assert default_max_connections(1024) > config.max_connections_per_client  # another address still gets in


def test_request_rates_per_address_and_kind():
    rates = RequestRates({RateKind.HTTP: Rate(2.0, 3), RateKind.UPGRADE: Rate(1.0, 1), RateKind.MESSAGE: Rate(1.0, 1)})
    assert [rates.take(RateKind.HTTP, "10.0.0.1", 0.0) for _ in range(4)] == [None, None, None, pytest.approx(0.5)]
    assert rates.take(RateKind.HTTP, "10.0.0.2", 0.0) is None  # another address has its own bucket
    assert rates.take(RateKind.UPGRADE, "10.0.0.1", 0.0) is None  # and another kind
    assert rates.take(RateKind.HTTP, "10.0.0.1", 0.5) is None
    assert RequestRates.REFUSALS[RateKind.HTTP] is Refusal.HTTP_RATE


def test_request_rates_table_stays_bounded_under_many_addresses():
    rates = RequestRates({w: Rate(1.0, 2) for w in RateKind}, size=100)
    for i in range(10_000):
        rates.take(RateKind.HTTP, f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}", now=i * 1e-3)
    assert len(rates) == 100


def test_request_rates_evict_the_idlest_address_and_keep_a_busy_one():
    rates = RequestRates({w: Rate(0.001, 2) for w in RateKind}, size=3)
    assert rates.take(RateKind.HTTP, "busy", 0.0) is None and rates.take(RateKind.HTTP, "busy", 0.0) is None
    for i in range(10):  # new addresses come and go; the busy one keeps coming back
        rates.take(RateKind.HTTP, f"new{i}", 1.0 + i)
        assert rates.take(RateKind.HTTP, "busy", 1.0 + i) is not None  # its bucket, still empty, was kept


def test_emptying_an_address_bucket_leaves_it_only_the_rate():
    rates = RequestRates({w: Rate(2.0, 10) for w in RateKind})
    rates.empty(RateKind.UPGRADE, "10.0.0.1", 0.0)
    assert rates.take(RateKind.UPGRADE, "10.0.0.1", 0.0) == pytest.approx(0.5)  # no burst left
    assert rates.take(RateKind.UPGRADE, "10.0.0.1", 0.5) is None  # the rate still refills it
    assert rates.take(RateKind.UPGRADE, "10.0.0.2", 0.0) is None and rates.take(RateKind.HTTP, "10.0.0.1", 0.0) is None
    bucket = TokenBucket(Rate(1.0, 5), now=0.0)
    bucket.empty(100.0)
    assert not bucket.take(100.0) and bucket.take(101.0)


def test_prune_drops_refilled_buckets_only():
    rates = RequestRates({w: Rate(1.0, 2) for w in RateKind}, size=10)
    rates.take(RateKind.HTTP, "a", 0.0)
    rates.take(RateKind.HTTP, "b", 0.0)
    rates.take(RateKind.HTTP, "b", 0.9)
    rates.prune(1.0)  # a has refilled to 2; b holds 1.0 (0.9 left at 0.9 s, plus 0.1)
    assert len(rates) == 1


def test_the_rate_table_forgets_addresses_gone_quiet_every_prune_period():
    """Over a long run the table holds the addresses of late: every RATE_PRUNE_PERIOD_S the buckets that have
    refilled go, however far the table is from its size."""
    rates = RequestRates({w: Rate(10.0, 5) for w in RateKind}, size=RATE_TABLE_SIZE)
    for i in range(500):  # many clients, once each, within the first seconds
        rates.take(RateKind.HTTP, f"10.0.{i >> 8}.{i & 255}", now=i * 0.01)
    assert len(rates) == 500
    rates.take(RateKind.UPGRADE, "10.1.0.1", now=RATE_PRUNE_PERIOD_S - 1)  # not yet a period since the last prune
    assert len(rates) == 501
    rates.take(RateKind.UPGRADE, "10.1.0.1", now=RATE_PRUNE_PERIOD_S + 0.1)  # its own bucket has refilled as well
    assert len(rates) == 1
    for _ in range(5):  # an address that spends its burst just before the next prune
        rates.take(RateKind.HTTP, "10.1.0.2", now=2 * RATE_PRUNE_PERIOD_S + 0.15)
    rates.take(RateKind.HTTP, "10.1.0.3", now=2 * RATE_PRUNE_PERIOD_S + 0.2)  # a period since the last prune
    assert len(rates) == 2  # 10.1.0.1 went; 10.1.0.2 stays, its bucket not full again; the newcomer
    assert rates.take(RateKind.HTTP, "10.1.0.2", now=2 * RATE_PRUNE_PERIOD_S + 0.2) is not None  # still over


def test_protocol_errors_close_at_the_limit_within_the_window():
    errors = ProtocolErrors(limit=3, window_s=10.0)
    assert [errors.add(t) for t in (0.0, 5.0)] == [False, False]
    assert errors.add(10.0) is True  # 3 within 10 s
    spread = ProtocolErrors(limit=3, window_s=10.0)
    assert not any(spread.add(t) for t in (0.0, 6.0, 12.0, 18.0, 24.0))  # a slow trickle of mistakes stays open
    assert spread.count == 5


def test_log_gate_lets_one_line_a_period_through_and_counts_the_rest():
    gate = LogGate(period_s=10.0)
    assert gate.allow("junk", 0.0) == 0
    assert [gate.allow("junk", t) for t in (1.0, 2.0, 9.9)] == [None, None, None]
    assert gate.allow("other", 1.0) == 0  # its own key
    assert gate.allow("junk", 10.0) == 3  # logged, with the three held back
    assert gate.allow("junk", 10.5) is None
