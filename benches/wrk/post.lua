-- wrk script for benches/proxy.sh: POST /orders with a small JSON body.
-- KEY_MODE=none: no Idempotency-Key (pass-through); unique: a new key per
-- request (every one a first request); fixed: the same key every time
-- (every one a replay once the first is answered).
local mode = os.getenv("KEY_MODE") or "none"
local run = os.getenv("KEY_RUN") or tostring(os.time())
local body = '{"sku":"A1","qty":2,"note":"benchmark order"}'
-- KEY_PATH: another path (benches/sealing.sh asks /orders?bytes=N for an
-- N-byte answer).
local path = os.getenv("KEY_PATH") or "/orders"
local counter = 0
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("thread_id", threads)
end

function request()
  -- One caller (the proxy refuses keyed requests that name none).
  local headers = { ["Content-Type"] = "application/json", ["Authorization"] = "Bearer bench" }
  if mode == "unique" then
    counter = counter + 1
    headers["Idempotency-Key"] = string.format('"%s-%d-%d"', run, thread_id or 0, counter)
  elseif mode == "fixed" then
    headers["Idempotency-Key"] = string.format('"%s-fixed"', run)
  end
  return wrk.format("POST", path, headers, body)
end

-- Answers other than 2xx/3xx (a 409, a 5xx) are counted by wrk itself:
-- reported, so errors cannot pass for speed.
function done(summary, latency, requests)
  io.write(string.format("NON2XX %d\n", summary.errors.status))
end
