-- The front's sample fetches for sequence models (loaded by HAProxy, see deployments/front.py):
-- the correlation id ("sequence_id") of an inference call, as the decimal integer or the
-- string (JSON escapes decoded), for the routing slot (CRC-32 of it, modulo the slots); "" when
-- there is none (a nil would reach HAProxy as 0). A call whose id is not found here goes to any
-- replica, which sends it on to the slot's replica itself.

local function varint(s, i)
    local value, shift = 0, 0
    while i <= #s do
        local b = s:byte(i)
        i = i + 1
        value = value | ((b & 0x7f) << shift)
        if b < 0x80 then
            return value, i
        end
        shift = shift + 7
        if shift > 63 then
            return nil, i
        end
    end
    return nil, i
end

-- Past one field of wire type `wire` starting at `i`; nil when it does not fit.
local function skip(s, i, wire)
    if wire == 0 then
        local value, j = varint(s, i)
        return value and j or nil
    elseif wire == 1 then
        return i + 8
    elseif wire == 2 then
        local length, j = varint(s, i)
        return length and j + length or nil
    elseif wire == 5 then
        return i + 4
    end
    return nil
end

-- Each field of a message: calls visit(field, wire, value) with a varint's value or a
-- length-delimited field's bytes (other wire types are skipped).
local function fields(s, visit)
    local i = 1
    while i <= #s do
        local tag
        tag, i = varint(s, i)
        if not tag then
            return
        end
        local field, wire = tag >> 3, tag & 7
        if wire == 0 then
            local value
            value, i = varint(s, i)
            if not value then
                return
            end
            if visit(field, wire, value) then
                return
            end
        elseif wire == 2 then
            local length
            length, i = varint(s, i)
            if not length or i + length - 1 > #s then
                return
            end
            if visit(field, wire, s:sub(i, i + length - 1)) then
                return
            end
            i = i + length
        else
            i = skip(s, i, wire)
            if not i then
                return
            end
        end
    end
end

-- ModelInferRequest: parameters (4) is a map<string, InferParameter>; an InferParameter holds
-- int64_param (2), string_param (3) or uint64_param (5).
local function grpc_sequence_id(message)
    local found
    fields(message, function(field, wire, value)
        if field ~= 4 or wire ~= 2 then
            return false
        end
        local key, parameter
        fields(value, function(f, w, v)
            if w == 2 and f == 1 then key = v elseif w == 2 and f == 2 then parameter = v end
            return false
        end)
        if key ~= "sequence_id" or not parameter then
            return false
        end
        fields(parameter, function(f, w, v)
            if w == 0 and (f == 2 or f == 5) and v >= 0 then
                found = string.format("%d", v)
            elseif w == 2 and f == 3 then
                found = v
            end
            return found ~= nil
        end)
        return true
    end)
    if found == "0" then
        return ""
    end
    return found or ""
end

core.register_fetches("rayinfer_grpc_sequence", function(txn)
    local body = txn.sf:req_body()
    if not body or #body < 5 then
        return ""
    end
    return grpc_sequence_id(body:sub(6))  -- past the gRPC frame's 5 bytes
end)

local ESCAPES = { ['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t' }

-- The JSON string whose opening quote is just before `i`, decoded (nil if it is malformed).
local function json_string(s, i)
    local out = {}
    while i <= #s do
        local c = s:sub(i, i)
        if c == '"' then
            return table.concat(out)
        elseif c ~= '\\' then
            local j = s:find('["\\]', i) or #s + 1
            out[#out + 1] = s:sub(i, j - 1)
            i = j
        else
            local e = s:sub(i + 1, i + 1)
            if e == "u" then
                local code = tonumber(s:sub(i + 2, i + 5), 16)
                if not code then
                    return nil
                end
                i = i + 6
                local low = s:sub(i, i + 1) == "\\u" and tonumber(s:sub(i + 2, i + 5), 16)
                if code >= 0xD800 and code < 0xDC00 and low and low >= 0xDC00 and low < 0xE000 then
                    code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                    i = i + 6
                end
                out[#out + 1] = utf8.char(code)
            elseif ESCAPES[e] then
                out[#out + 1] = ESCAPES[e]
                i = i + 2
            else
                return nil
            end
        end
    end
    return nil
end

core.register_fetches("rayinfer_http_sequence", function(txn)
    local body = txn.sf:req_body()
    if not body then
        return ""
    end
    local length = tonumber(txn.sf:req_hdr("inference-header-content-length") or "")
    if length and length > 0 then
        body = body:sub(1, length)
    end
    local found = body:match('"sequence_id"%s*:%s*(%d+)')
    if not found then
        local at = select(2, body:find('"sequence_id"%s*:%s*"'))
        found = at and json_string(body, at + 1)
    end
    if found == "0" then
        return ""
    end
    return found or ""
end)

-- The value of the header a model in a rollout picks its version by (its name, lowercase, in
-- txn.split_header: transport/router.py), whole and as last given; "" when it is absent.
core.register_fetches("rayinfer_split_key", function(txn)
    local name = txn:get_var("txn.split_header")
    if not name or name == "" then
        return ""
    end
    return txn.sf:req_fhdr(name) or ""
end)
