// pybind11 module sssd._core: glue only (argument checks, span borrowing,
// GIL release, result wrapping). Algorithms live in cpp/src.
//
// Rules: inputs are borrowed with the GIL held, work runs in an inner scope
// with the GIL released, outputs are built after it is reacquired. C++
// exceptions map to Python ones: std::invalid_argument -> ValueError,
// sssd::UnknownRequest -> KeyError, sssd::Error -> sssd.SSSDError,
// std::bad_alloc -> MemoryError.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <memory>
#include <optional>

#include "numpy_util.h"
#include "sssd/check.h"
#include "sssd/continuation_tree.h"
#include "sssd/datastore.h"
#include "sssd/drafter.h"
#include "sssd/parent_tree.h"
#include "sssd/recent_store.h"
#include "sssd/request_trie.h"
#include "sssd/source_evidence.h"
#include "sssd/suffix_automaton.h"
#include "sssd/suffix_sort.h"
#include "sssd/tree_merger.h"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace py = pybind11;
using namespace pybind11::literals;
using sssd::py_util::borrow;
using sssd::py_util::Borrowed;
using sssd::py_util::request_id;
using sssd::py_util::to_numpy;
using sssd::py_util::RequestIds;
using sssd::py_util::Tokens;
using sssd::py_util::view;

namespace {

// Thrown through the core when a Python progress callback raised; the saved
// Python error is re-raised once the GIL is back.
struct CallbackFailed {};

// Wraps a Python progress callable for use without the GIL.
struct ProgressBridge {
  py::object fn;
  std::optional<py::error_already_set> error;
  sssd::SortProgress callback() {
    if (fn.is_none()) return {};
    return [this](size_t done, size_t total) {
      py::gil_scoped_acquire gil;
      try {
        if (PyErr_CheckSignals() != 0) throw py::error_already_set();
        fn(done, total);
      } catch (py::error_already_set& e) {
        error.emplace(std::move(e));
        throw CallbackFailed{};
      }
    };
  }
};

// The binding of a method that takes token lists for many requests as CSR arrays (request ids[b]'s
// are tokens[offsets[b]:offsets[b + 1]]): the arrays borrowed or converted, the GIL released.
template <typename T>
auto csr_tokens(void (T::*method)(std::span<const uint64_t>, std::span<const int64_t>, std::span<const sssd::token_t>)) {
  return [method](T& self, const py::array& ids, const py::array& offsets, const py::array& tokens) {
    const RequestIds id_span(ids);
    const auto off = borrow<int64_t>(offsets, "offsets");
    const Tokens t(tokens, "tokens");
    py::gil_scoped_release release;
    (self.*method)(id_span.span(), off, t.span());
  };
}

py::dict draft_batch_to_dict(sssd::DraftBatch&& batch) {
  std::vector<int64_t> tokens(batch.nodes.tokens.begin(), batch.nodes.tokens.end());
  py::dict d;
  d["offsets"] = to_numpy(std::move(batch.offsets));
  d["tokens"] = to_numpy(std::move(tokens));
  d["parents"] = to_numpy(std::move(batch.nodes.parents));
  d["depths"] = to_numpy(std::move(batch.nodes.depths));
  d["scores"] = to_numpy(std::move(batch.nodes.scores));
  d["probs"] = to_numpy(std::move(batch.nodes.probs));
  d["match_lens"] = to_numpy(std::move(batch.nodes.match_lens));
  d["sources"] = to_numpy(std::move(batch.nodes.sources));
  d["draft_probs"] = to_numpy(std::move(batch.nodes.draft_probs));
  return d;
}

// A continuation tree as parent-pointer arrays (parents precede children).
py::dict tree_to_dict(const sssd::SourceTree& t) {
  std::vector<int64_t> tokens;
  std::vector<int32_t> parents;
  std::vector<double> weights;
  if (!t.empty()) {
    std::vector<std::pair<uint32_t, int32_t>> queue{{t.root, -1}};
    for (size_t head = 0; head < queue.size(); ++head) {
      const auto [node, parent_out] = queue[head];
      int32_t id = -1;
      if (head > 0) {
        id = int32_t(tokens.size());
        tokens.push_back(t.nodes[node].token);
        parents.push_back(parent_out);
        weights.push_back(t.nodes[node].weight);
      }
      for (uint32_t c = t.nodes[node].first_child; c != sssd::kNoNode; c = t.nodes[c].next_sibling) {
        queue.push_back({c, id});
      }
    }
  }
  py::dict d;
  d["tokens"] = to_numpy(std::move(tokens));
  d["parents"] = to_numpy(std::move(parents));
  d["weights"] = to_numpy(std::move(weights));
  d["total"] = t.empty() ? 0.0 : t.total;
  d["match_len"] = t.match_len;
  return d;
}

sssd::ScoreTable make_table(int max_match, int max_depth, const py::array& factors,
                            py::object curve_of, py::object curves, int num_sources) {
  const auto f = borrow<double>(factors, "factors");
  std::vector<int32_t> cells;
  std::vector<sssd::Curve> parsed;
  if (!curve_of.is_none()) {
    const auto c = borrow<int32_t>(curve_of.cast<py::array>(), "curve_of");
    cells.assign(c.begin(), c.end());
    for (py::handle item : curves.cast<py::list>()) {
      auto xy = item.cast<py::tuple>();
      const auto x = borrow<double>(xy[0].cast<py::array>(), "curve knots");
      const auto y = borrow<double>(xy[1].cast<py::array>(), "curve values");
      parsed.push_back({std::vector<double>(x.begin(), x.end()), std::vector<double>(y.begin(), y.end())});
    }
  }
  return sssd::ScoreTable(max_match, max_depth, std::vector<double>(f.begin(), f.end()), std::move(cells),
                          std::move(parsed), num_sources);
}

}  // namespace

static py::tuple repeat_tuple(const sssd::SuffixAutomaton::Repeat& r) {
  py::list ends;
  for (int i = 0; i < r.count; ++i) ends.append(r.ends[i]);
  return py::make_tuple(r.length, ends);
}

PYBIND11_MODULE(_core, m, py::mod_gil_not_used()) {
  m.doc() = "SSSD native core: suffix-array datastore, request trie, draft-tree merge.";

  py::register_exception<sssd::Error>(m, "SSSDError", PyExc_RuntimeError);
  // Registered after SSSDError, so tried first (translators run newest first).
  py::register_exception<sssd::CorruptFile>(m, "CorruptDatastoreError",
                                            py::make_tuple(m.attr("SSSDError"), py::handle(PyExc_ValueError)));
  py::register_exception<sssd::UnknownRequest>(m, "UnknownRequestError", PyExc_KeyError);

  m.attr("SEPARATOR") = sssd::kSeparator;
  m.attr("MAX_TOKEN_ID") = sssd::kMaxTokenId;
  m.attr("MAX_BUDGET") = sssd::kMaxBudget;
  m.attr("MAX_SOURCES") = sssd::kMaxSources;
  m.attr("FORMAT_VERSION") = sssd::kFormatVersion;
  m.attr("TOKENS_FILE") = sssd::kTokensFile;
  m.attr("SUFFIX_ARRAY_FILE") = sssd::kSuffixArrayFile;
  m.attr("TOKEN_INDEX_FILE") = sssd::kTokenIndexFile;

  m.def("build_info", [] {
    py::dict d;
#ifdef _OPENMP
    d["openmp"] = true;
    d["omp_max_threads"] = omp_get_max_threads();
#else
    d["openmp"] = false;
    d["omp_max_threads"] = 1;
#endif
    d["compiler"] = __VERSION__;
    d["native_arch"] = SSSD_NATIVE_ARCH != 0;
    d["cxx_standard"] = long(__cplusplus);
    return d;
  }, "How this extension was built (OpenMP, threads, compiler, -march=native).");

  m.def("build_suffix_array", [](const py::array& tokens, int num_threads, py::object progress) {
    const auto text = borrow<sssd::token_t>(tokens, "tokens");
    ProgressBridge bridge{std::move(progress)};
    auto cb = bridge.callback();
    auto run = [&](auto index_tag) -> py::array {
      using Index = decltype(index_tag);
      std::vector<Index> sa(text.size());
      try {
        py::gil_scoped_release release;
        sssd::build_suffix_array<Index>(text, sa, num_threads, cb);
      } catch (const CallbackFailed&) {
        throw *bridge.error;
      }
      return to_numpy(std::move(sa));
    };
    if (text.size() < size_t(UINT32_MAX) - 1) return run(uint32_t{});
    return run(uint64_t{});
  }, "tokens"_a, "num_threads"_a = 0, "progress"_a = py::none(),
     "Suffix array of a uint32 token stream (the separator sorts above every token; suffixes compare on past it).");

  m.def("stream_stats", [](const py::array& tokens, int num_threads) {
    const auto text = borrow<sssd::token_t>(tokens, "tokens");
    sssd::StreamStats st;
    {
      py::gil_scoped_release release;
      st = sssd::stream_stats(text, num_threads);
    }
    return py::dict("count"_a = st.count, "vocab_size"_a = st.vocab_size,
                    "num_docs"_a = st.num_docs, "fingerprint"_a = st.fingerprint);
  }, "tokens"_a, "num_threads"_a = 0);

  py::class_<sssd::DatastoreQuery>(m, "DatastoreQuery")
      .def(py::init<>())
      .def_readwrite("max_match", &sssd::DatastoreQuery::max_match)
      .def_readwrite("min_match", &sssd::DatastoreQuery::min_match)
      .def_readwrite("max_samples", &sssd::DatastoreQuery::max_samples)
      .def_readwrite("min_occurrences", &sssd::DatastoreQuery::min_occurrences)
      .def_readwrite("branch_len", &sssd::DatastoreQuery::branch_len)
      .def_readwrite("branch_per_match", &sssd::DatastoreQuery::branch_per_match)
      .def_readwrite("max_branch_len", &sssd::DatastoreQuery::max_branch_len)
      .def_readwrite("match_boost", &sssd::DatastoreQuery::match_boost)
      .def("branch_for", &sssd::DatastoreQuery::branch_for, "match"_a,
           "continuation length of an occurrence matching `match` context tokens")
      .def("deepest", &sssd::DatastoreQuery::deepest, "the longest continuation (the tree's depth)")
      .def_readwrite("end_token", &sssd::DatastoreQuery::end_token);

  // pybind11 holders cannot be pointer-to-const; the object is immutable anyway.
  using DatastorePtr = std::shared_ptr<sssd::Datastore>;
  py::class_<sssd::Datastore, DatastorePtr>(m, "Datastore")
      .def_static("open", [](const std::string& dir, bool validate, int num_threads) {
        py::gil_scoped_release release;
        return std::const_pointer_cast<sssd::Datastore>(sssd::Datastore::open(dir, validate, num_threads));
      }, "directory"_a, "validate"_a = true, "num_threads"_a = 0,
         "Maps a datastore directory. validate: check the body's structure (one parallel pass; "
         "CorruptDatastoreError, a ValueError, names the file and the problem); without it only "
         "headers are read, and a corrupt body gives exceptions or meaningless trees, never a crash.")
      .def("validate", [](const sssd::Datastore& ds, int num_threads) {
        py::gil_scoped_release release;
        ds.validate(num_threads);
      }, "num_threads"_a = 0, "Checks the body's structure; raises CorruptDatastoreError (a ValueError).")
      .def_static("from_tokens", [](const py::array& tokens, int num_threads) {
        const auto text = borrow<sssd::token_t>(tokens, "tokens");
        py::gil_scoped_release release;
        return std::const_pointer_cast<sssd::Datastore>(sssd::Datastore::from_tokens(text, num_threads));
      }, "tokens"_a, "num_threads"_a = 0)
      .def_static("write", [](const py::array& tokens, const std::string& dir, int num_threads,
                              py::object progress) {
        const auto text = borrow<sssd::token_t>(tokens, "tokens");
        ProgressBridge bridge{std::move(progress)};
        auto cb = bridge.callback();
        try {
          py::gil_scoped_release release;
          sssd::Datastore::write(text, dir, num_threads, cb);
        } catch (const CallbackFailed&) {
          throw *bridge.error;
        }
      }, "tokens"_a, "directory"_a, "num_threads"_a = 0, "progress"_a = py::none())
      .def_property_readonly("size", &sssd::Datastore::size)
      .def_property_readonly("vocab_size", &sssd::Datastore::vocab_size)
      .def_property_readonly("num_docs", &sssd::Datastore::num_docs)
      .def_property_readonly("fingerprint", &sssd::Datastore::fingerprint)
      .def_property_readonly("index_bytes", &sssd::Datastore::index_bytes)
      .def_property_readonly("mapped", &sssd::Datastore::mapped)
      .def("tokens", [](py::object self) {
        const auto& ds = self.cast<const sssd::Datastore&>();
        return view(ds.tokens().data(), ds.size(), self);
      }, "Read-only view of the token stream (no copy).")
      .def("suffix", &sssd::Datastore::suffix, "rank"_a)
      .def("suffix_array", [](py::object self) -> py::array {
        const auto& ds = self.cast<const sssd::Datastore&>();
        const auto* raw = ds.suffix_array_data();
        if (ds.index_bytes() == 4) return view(reinterpret_cast<const uint32_t*>(raw), ds.size(), self);
        return view(reinterpret_cast<const uint64_t*>(raw), ds.size(), self);
      }, "Read-only view of the suffix array (uint32 or uint64, no copy). Entries are not range-checked.")
      .def("warm", [](const sssd::Datastore& ds) {
        py::gil_scoped_release release;
        return ds.warm();
      }, "Reads every mapped page in (no page faults in later queries until reclaimed); returns the bytes.")
      .def("lock", [](const sssd::Datastore& ds) {
        py::gil_scoped_release release;
        return ds.lock();
      }, "Pins every mapped page in memory (mlock) for the datastore's lifetime; returns the bytes.")
      .def("page_out", [](const sssd::Datastore& ds) {
        py::gil_scoped_release release;
        return ds.page_out();
      }, "Asks the kernel to reclaim the unlocked pages now (MADV_PAGEOUT), as memory pressure would.")
      .def("resident_bytes", [](const sssd::Datastore& ds) {
        py::gil_scoped_release release;
        return ds.resident_bytes();
      }, "Bytes of the mapped files now in memory (mincore).")
      .def("find", [](const sssd::Datastore& ds, const py::array& pattern) {
        const Tokens p(pattern, "pattern");
        py::gil_scoped_release release;
        return ds.find(p.span());
      }, "pattern"_a)
      .def("query", [](const sssd::Datastore& ds, const py::array& context,
                       const sssd::DatastoreQuery& q) {
        const Tokens c(context, "context");
        sssd::check_query(q);
        sssd::ContinuationTree tree;
        sssd::QueryStats st;
        {
          py::gil_scoped_release release;
          st = ds.query(c.span(), q, tree);
          tree.expand_all();
        }
        py::dict d = tree_to_dict(tree.view(sssd::Source::kDatastore, st.match_len, q.branch_len));
        d["occurrences"] = st.occurrences;
        d["levels"] = st.levels;
        d["samples"] = st.samples;
        d["total"] = double(tree.root_weight());
        return d;
      }, "context"_a, "params"_a, "The continuation tree for a context, as parent-pointer arrays.");

  py::class_<sssd::SuffixAutomaton>(m, "SuffixAutomaton")
      .def(py::init<size_t>(), "max_tokens"_a = size_t(1) << 20)
      .def("extend", [](sssd::SuffixAutomaton& a, const py::array& tokens) {
        const Tokens t(tokens, "tokens");
        py::gil_scoped_release release;
        for (const sssd::token_t x : t.span()) a.extend(x);
      }, "tokens"_a)
      .def("longest_repeat", [](const sssd::SuffixAutomaton& a) { return repeat_tuple(a.longest_repeat()); },
           "(length, [end positions of earlier occurrences, most recent first]) of the longest suffix that "
           "ended earlier too; (0, []) if none")
      .def_property_readonly("size", &sssd::SuffixAutomaton::size)
      .def_property_readonly("capped", &sssd::SuffixAutomaton::capped)
      .def_property_readonly("num_states", &sssd::SuffixAutomaton::num_states)
      .def("memory_bytes", &sssd::SuffixAutomaton::memory_bytes)
      .def("check_integrity", &sssd::SuffixAutomaton::check_integrity);

  py::class_<sssd::RequestTrie>(m, "RequestTrie")
      .def(py::init([](int max_depth, size_t max_nodes, size_t copy_max_tokens, int copy_min_match,
                       double copy_half_life) {
             return sssd::RequestTrie(max_depth, max_nodes, {copy_max_tokens, copy_min_match, copy_half_life});
           }),
           "max_depth"_a, "max_nodes"_a = size_t(1) << 24, "copy_max_tokens"_a = 0, "copy_min_match"_a = 8,
           "copy_half_life"_a = 32.0)
      .def("repeat", [](const sssd::RequestTrie& t) { return repeat_tuple(t.copy().repeat()); })
      .def("copy_rate", [](const sssd::RequestTrie& t, double prior, double pseudo) {
        return t.copy().rate(prior, pseudo);
      }, "prior"_a, "pseudo"_a)
      .def_property_readonly("copy_hits", [](const sssd::RequestTrie& t) { return t.copy().hits(); })
      .def_property_readonly("copy_trials", [](const sssd::RequestTrie& t) { return t.copy().trials(); })
      .def_property_readonly("copy_cursor", [](const sssd::RequestTrie& t) -> py::object {
        const uint32_t c = t.copy().cursor();
        return c == sssd::CopyIndex::kNoCursor ? py::none() : py::object(py::int_(c));
      })
      .def_property_readonly("copy_edits", [](const sssd::RequestTrie& t) {
        py::list out;
        for (const auto& e : t.copy().edits()) out.append(py::make_tuple(e.anchor, e.removed, e.inserted));
        return out;
      }, "the remembered edits, most recent first: (anchor, removed tokens, inserted tokens)")
      .def("resync", [](const sssd::RequestTrie& t) {
        const auto r = t.copy().resync(t.tokens());
        return py::make_tuple(r.length, r.end);
      })
      .def("extend", [](sssd::RequestTrie& t, const py::array& tokens) {
        t.extend(borrow<sssd::token_t>(tokens, "tokens"));
      }, "tokens"_a)
      .def("continuations", [](const sssd::RequestTrie& t, int len) {
        return tree_to_dict(t.continuations(len));
      }, "length"_a)
      .def_property_readonly("size", &sssd::RequestTrie::size)
      .def_property_readonly("num_nodes", &sssd::RequestTrie::num_nodes)
      .def_property_readonly("max_depth", &sssd::RequestTrie::max_depth)
      .def("memory_bytes", &sssd::RequestTrie::memory_bytes)
      .def("check_integrity", &sssd::RequestTrie::check_integrity);

  py::class_<sssd::SourceEvidence>(m, "SourceEvidence")
      .def(py::init([](double prior, double half_life, double level_floor, std::pair<float, float> scale_bounds,
                       std::pair<float, float> level_bounds) {
             return std::make_unique<sssd::SourceEvidence>(sssd::EvidenceSettings{
                 prior, half_life, level_floor, scale_bounds.first, scale_bounds.second, level_bounds.first,
                 level_bounds.second});
           }),
           "prior"_a = 2.0, "half_life"_a = 16.0, "level_floor"_a = 0.3, "scale_bounds"_a = std::make_pair(0.25f, 4.0f),
           "level_bounds"_a = std::make_pair(0.5f, 1.5f),
           "Each open request's acceptance by source and the merge's factors it gives (source_evidence.h).")
      .def("open", [](sssd::SourceEvidence& e, py::handle rid, int64_t length) {
        SSSD_CHECK_ARG(length >= 0, "length must be >= 0, got ", length);
        e.open(request_id(rid), size_t(length));
      }, "request_id"_a, "length"_a)
      .def("close", [](sssd::SourceEvidence& e, py::handle rid) { e.close(request_id(rid)); }, "request_id"_a)
      .def("__contains__", [](const sssd::SourceEvidence& e, py::handle rid) {
        try {
          return e.contains(request_id(rid));
        } catch (const py::value_error&) {
          return false;
        }
      })
      .def("__len__", &sssd::SourceEvidence::size)
      .def("counts", [](const sssd::SourceEvidence& e, py::handle rid) {
        const auto c = e.counts(request_id(rid));
        py::array_t<double> out({4, int(sssd::kMaxSources)});
        std::copy(c.begin(), c.end(), out.mutable_data());
        return out;
      }, "request_id"_a, "[4, MAX_SOURCES]: observed, expected at depth 1; observed, expected deeper.")
      .def("factors", [](const sssd::SourceEvidence& e, const py::array& ids) {
        const RequestIds id_span(ids);
        const size_t n = id_span.span().size();
        py::array_t<float> out({py::ssize_t(n), py::ssize_t(sssd::kMaxSources), py::ssize_t(2)});
        const std::span<float> o(out.mutable_data(), n * sssd::kMaxSources * 2);
        {
          py::gil_scoped_release release;
          e.factors(id_span.span(), o);
        }
        return out;
      }, "request_ids"_a, "[n, MAX_SOURCES, 2] float32: each request's (scale, level) per source (1: not open).")
      .def("drafted", [](sssd::SourceEvidence& e, const py::array& ids, const py::array& lengths, py::dict batch,
                         py::object factors) {
        const RequestIds id_span(ids);
        const auto len = borrow<int64_t>(lengths, "lengths");
        const auto offsets = borrow<int64_t>(batch["offsets"].cast<py::array>(), "offsets");
        const auto tokens = borrow<int64_t>(batch["tokens"].cast<py::array>(), "tokens");
        const auto parents = borrow<int32_t>(batch["parents"].cast<py::array>(), "parents");
        const auto depths = borrow<int32_t>(batch["depths"].cast<py::array>(), "depths");
        const auto sources = borrow<uint8_t>(batch["sources"].cast<py::array>(), "sources");
        const auto scores = borrow<float>(batch["scores"].cast<py::array>(), "scores");
        std::optional<py::array_t<float, py::array::c_style | py::array::forcecast>> f;
        std::span<const float> f_span;
        if (!factors.is_none()) {
          f = factors.cast<py::array_t<float, py::array::c_style | py::array::forcecast>>();
          f_span = {f->data(), size_t(f->size())};
        }
        const sssd::DraftedTrees trees{offsets, tokens, parents, depths, sources, scores};
        py::gil_scoped_release release;
        e.drafted(id_span.span(), len, trees, f_span);
      }, "request_ids"_a, "lengths"_a, "batch"_a, "factors"_a = py::none(),
         "Keeps a draft call's trees (a dict of DraftBatch arrays: offsets, tokens, parents, depths, sources, "
         "scores; drafted with `factors`, None: all 1) for requests whose contexts were `lengths` long.")
      .def("extended", csr_tokens(&sssd::SourceEvidence::extended), "request_ids"_a, "offsets"_a, "tokens"_a,
         "The requests' next tokens (CSR): each kept tree drafted at this context is scored by them.");

  py::class_<sssd::RecentStore>(m, "RecentStore")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, double>(), "capacity"_a,
           "max_match"_a = 8, "min_match"_a = 2, "max_matches"_a = 16, "depth"_a = 64, "max_chain"_a = 64,
           "depth_per_match"_a = 8.0, "match_damping"_a = 0.8,
           "The other requests' recent tokens in a ring of `capacity`, and drafts from them (recent_store.h).")
      .def("open", [](sssd::RecentStore& s, py::handle rid, const py::array& prompt_tail) {
        const uint64_t id = request_id(rid);
        const Tokens p(prompt_tail, "prompt");
        py::gil_scoped_release release;
        s.open(id, p.span());
      }, "request_id"_a, "prompt_tail"_a, "Starts a request: stores the prompt's last max_match tokens.")
      .def("extend", [](sssd::RecentStore& s, py::handle rid, const py::array& tokens) {
        const uint64_t id = request_id(rid);
        const Tokens t(tokens, "tokens");
        py::gil_scoped_release release;
        s.extend(id, t.span());
      }, "request_id"_a, "tokens"_a)
      .def("extend_batch", csr_tokens(&sssd::RecentStore::extend_batch), "request_ids"_a, "offsets"_a, "tokens"_a,
         "Appends tokens to many requests under one lock: request_ids[b] gets tokens[offsets[b]:offsets[b + 1]] "
         "(every argument is checked before any request changes).")
      .def("close", [](sssd::RecentStore& s, py::handle rid) {
        const uint64_t id = request_id(rid);
        py::gil_scoped_release release;
        s.close(id);
      }, "request_id"_a, "Forgets the request's place; its tokens stay until the ring overwrites them.")
      .def("clear", [](sssd::RecentStore& s) {
        py::gil_scoped_release release;
        s.clear();
      }, "Forgets every token written so far and every request's place (a fresh store).")
      .def("propose", [](const sssd::RecentStore& s, const py::array& ids, const py::sequence& contexts,
                         const py::array& budgets) {
        const RequestIds id_span(ids);
        const size_t R = id_span.span().size(), K = size_t(s.max_match());
        if (size_t(py::len(contexts)) != R) {
          throw py::value_error("contexts: expected " + std::to_string(R) + " (one per request), got " +
                                std::to_string(py::len(contexts)));
        }
        if (budgets.ndim() != 1 || (budgets.dtype().kind() != 'i' && budgets.dtype().kind() != 'u')) {
          throw py::type_error("budgets: expected a 1-D integer array");
        }
        const py::array_t<int64_t, py::array::c_style | py::array::forcecast> b(budgets);
        // Each context's last max_match tokens, newest first, -1 before its start.
        std::vector<int64_t> queries(R * K, -1);
        for (size_t r = 0; r < R; ++r) {
          const py::array c = py::array::ensure(contexts[r]);
          const char kind = c ? c.dtype().kind() : 0;
          if (!c || c.ndim() != 1 || (kind != 'i' && kind != 'u')) {
            throw py::type_error("contexts[" + std::to_string(r) + "]: expected a 1-D array of token ids");
          }
          const py::array_t<int64_t, py::array::forcecast> t(c);  // a view when it is int64 already
          const auto v = t.unchecked<1>();
          const size_t n = size_t(t.shape(0)), keep = std::min(n, K);
          for (size_t j = 0; j < keep; ++j) {
            const int64_t x = v(py::ssize_t(n - 1 - j));
            if (x < 0 || x > int64_t(sssd::kMaxTokenId)) {
              throw py::value_error("contexts[" + std::to_string(r) + "]: token ids are >= 0 and <= " +
                                    std::to_string(sssd::kMaxTokenId) + ", got " +
                                    (kind == 'u' ? std::to_string(uint64_t(x)) : std::to_string(x)));
            }
            queries[r * K + j] = x;
          }
        }
        const std::span<const int64_t> b_span(b.data(), size_t(b.size()));
        sssd::RecentDrafts drafts;
        {
          py::gil_scoped_release release;
          drafts = s.propose(id_span.span(), queries, b_span);
        }
        return py::make_tuple(to_numpy(std::move(drafts.offsets)), to_numpy(std::move(drafts.tokens)),
                              to_numpy(std::move(drafts.parents)), to_numpy(std::move(drafts.weights)));
      }, "request_ids"_a, "contexts"_a, "budgets"_a,
         "Drafts for a batch: request_ids [R], contexts (R 1-D integer arrays: each request's tokens so far; "
         "only the last max_match are read), budgets [R] (>= 0). Returns (offsets [R + 1], tokens int64, "
         "parents int32 (request-local, -1: the root), weights float32): request r's nodes are "
         "offsets[r]:offsets[r + 1].")
      .def("history", [](const sssd::RecentStore& s, py::handle rid) {
        const uint64_t id = request_id(rid);
        std::vector<sssd::token_t> h;
        {
          py::gil_scoped_release release;
          h = s.history(id);
        }
        std::vector<int64_t> out(h.begin(), h.end());
        return to_numpy(std::move(out));
      }, "request_id"_a, "The request's tokens still held, oldest first (its links walked back).")
      .def("__len__", &sssd::RecentStore::size, "tokens held")
      .def_property_readonly("written", &sssd::RecentStore::written, "tokens ever written")
      .def_property_readonly("capacity", &sssd::RecentStore::capacity)
      .def_property_readonly("max_match", &sssd::RecentStore::max_match)
      .def("memory_bytes", &sssd::RecentStore::memory_bytes, "bytes allocated (the ring and the bucket heads)")
      .def_readonly_static("MIN_DEPTH", &sssd::RecentStore::kMinDepth,
                           "tokens followed after a match however short (unless depth or the budget is smaller)");

  py::class_<sssd::ScoreTable>(m, "ScoreTable")
      .def(py::init(&make_table), "max_match"_a, "max_depth"_a, "factors"_a, "curve_of"_a = py::none(),
           "curves"_a = py::none(), "num_sources"_a = sssd::kNumSources,
           "factors/curve_of: [source][match_len][depth] flattened; curves: list of (knots, values) arrays")
      .def("__call__", [](const sssd::ScoreTable& t, int source, int match_len, int depth) {
        SSSD_CHECK_ARG(source >= 0 && source < t.num_sources(), "unknown source ", source);
        return t(sssd::Source(source), match_len, depth);
      }, "source"_a, "match_len"_a, "depth"_a)
      .def("priority", [](const sssd::ScoreTable& t, int source, int match_len, int depth, double p) {
        SSSD_CHECK_ARG(source >= 0 && source < t.num_sources(), "unknown source ", source);
        return t.priority(sssd::Source(source), match_len, depth, p);
      }, "source"_a, "match_len"_a, "depth"_a, "prob"_a)
      .def_property_readonly("num_sources", &sssd::ScoreTable::num_sources)
      .def_property_readonly("calibrated", &sssd::ScoreTable::calibrated)
      .def_property_readonly("max_match", &sssd::ScoreTable::max_match)
      .def_property_readonly("max_depth", &sssd::ScoreTable::max_depth);

  py::class_<sssd::DrafterParams>(m, "DrafterParams")
      .def(py::init<>())
      .def_readwrite("datastore", &sssd::DrafterParams::datastore)
      .def_readwrite("use_datastore", &sssd::DrafterParams::use_datastore)
      .def_readwrite("use_input", &sssd::DrafterParams::use_input)
      .def_readwrite("input_max_match", &sssd::DrafterParams::input_max_match)
      .def_readwrite("input_branch_len", &sssd::DrafterParams::input_branch_len)
      .def_readwrite("input_max_nodes", &sssd::DrafterParams::input_max_nodes)
      .def_readwrite("copy_min_match", &sssd::DrafterParams::copy_min_match)
      .def_readwrite("copy_branch_per_match", &sssd::DrafterParams::copy_branch_per_match)
      .def_readwrite("copy_max_branch_len", &sssd::DrafterParams::copy_max_branch_len)
      .def_readwrite("copy_occurrences", &sssd::DrafterParams::copy_occurrences)
      .def_readwrite("copy_rate", &sssd::DrafterParams::copy_rate)
      .def_readwrite("copy_evidence", &sssd::DrafterParams::copy_evidence)
      .def_readwrite("copy_half_life", &sssd::DrafterParams::copy_half_life)
      .def_readwrite("copy_exclusion", &sssd::DrafterParams::copy_exclusion)
      .def_readwrite("copy_edit_weight", &sssd::DrafterParams::copy_edit_weight)
      .def_readwrite("copy_max_tokens", &sssd::DrafterParams::copy_max_tokens)
      .def_readwrite("scores", &sssd::DrafterParams::scores)
      .def_readwrite("vocab_size", &sssd::DrafterParams::vocab_size);

  py::class_<sssd::Drafter>(m, "Drafter")
      .def(py::init<DatastorePtr, sssd::DrafterParams, int>(), "datastore"_a, "params"_a,
           "num_threads"_a = 0)
      .def_property("num_threads", &sssd::Drafter::num_threads, [](sssd::Drafter& d, int n) {
        if (n < 0) throw std::invalid_argument("num_threads must be >= 0 (0: all cores), got " + std::to_string(n));
        d.set_num_threads(n);
      }, "batch drafting's OpenMP threads (set: from the next call on; 0: all cores)")
      .def("open", [](sssd::Drafter& d, py::handle rid, const py::array& prompt) {
        const uint64_t id = request_id(rid);
        const Tokens p(prompt, "prompt");
        py::gil_scoped_release release;
        d.open(id, p.span());
      }, "request_id"_a, "prompt"_a)
      .def("extend", [](sssd::Drafter& d, py::handle rid, const py::array& tokens) {
        const uint64_t id = request_id(rid);
        const Tokens t(tokens, "tokens");
        py::gil_scoped_release release;
        d.extend(id, t.span());
      }, "request_id"_a, "tokens"_a)
      .def("extend_batch", csr_tokens(&sssd::Drafter::extend_batch), "request_ids"_a, "offsets"_a, "tokens"_a)
      .def("close", [](sssd::Drafter& d, py::handle rid) {
        const uint64_t id = request_id(rid);
        py::gil_scoped_release release;
        d.close(id);
      }, "request_id"_a)
      .def("__contains__", [](const sssd::Drafter& d, py::handle rid) {
        // Like a dict: an int that cannot be an id is simply not there.
        try {
          return d.contains(request_id(rid));
        } catch (const py::value_error&) {
          return false;
        }
      })
      .def("__len__", &sssd::Drafter::num_requests)
      .def("request_ids", &sssd::Drafter::request_ids)
      .def("context", [](const sssd::Drafter& d, py::handle rid) { return to_numpy(d.context(request_id(rid))); },
           "request_id"_a)
      .def("request_memory", [](const sssd::Drafter& d, py::handle rid) { return d.request_memory(request_id(rid)); },
           "request_id"_a)
      .def("datastore_queries", [](const sssd::Drafter& d) {
        const auto c = d.datastore_queries();
        return py::make_tuple(c.drafted, c.skipped);
      }, "(requests drafted with the datastore on, of which skipped its query) since the drafter was made")
      .def("draft", [](const sssd::Drafter& d, const py::array& ids, const py::array& budgets,
                       py::object external, const sssd::DrafterParams* params, py::object source_factors,
                       py::object recent) {
        const RequestIds id_span(ids);
        const auto budget_span = borrow<int32_t>(budgets, "budgets");
        // The holders own copies of misaligned arrays: they outlive `ext`.
        std::optional<sssd::ExternalTrees> ext;
        std::optional<Tokens> ext_tokens;
        std::optional<Borrowed<int64_t>> ext_offsets;
        std::optional<Borrowed<int32_t>> ext_parents;
        std::optional<Borrowed<float>> ext_weights, ext_q;
        std::optional<Borrowed<uint8_t>> ext_sources;
        py::dict ext_dict;
        if (!external.is_none()) {
          // {offsets, tokens, parents, weights[, q, sources]}; or {..., probs}: one model source
          // whose q also ranks its candidates.
          ext_dict = external.cast<py::dict>();
          ext_tokens.emplace(ext_dict["tokens"].cast<py::array>(), "external tokens");
          ext_offsets.emplace(ext_dict["offsets"].cast<py::array>(), "external offsets");
          ext_parents.emplace(ext_dict["parents"].cast<py::array>(), "external parents");
          const bool legacy = !ext_dict.contains("weights");
          ext_weights.emplace(ext_dict[legacy ? "probs" : "weights"].cast<py::array>(), "external weights");
          if (legacy || ext_dict.contains("q")) {
            ext_q.emplace(ext_dict[legacy ? "probs" : "q"].cast<py::array>(), "external q");
          }
          if (ext_dict.contains("sources")) ext_sources.emplace(ext_dict["sources"].cast<py::array>(), "external sources");
          ext = sssd::ExternalTrees{*ext_offsets, ext_tokens->span(), *ext_parents, *ext_weights,
                                    ext_q ? std::span<const float>(*ext_q) : std::span<const float>{},
                                    ext_sources ? std::span<const uint8_t>(*ext_sources) : std::span<const uint8_t>{}};
        }
        // [n, kMaxSources, 2] float32: per request and source tag, (scale, level).
        std::vector<float> factor_scale, factor_level;
        std::optional<sssd::SourceFactors> factors;
        if (!source_factors.is_none()) {
          using Floats = py::array_t<float, py::array::c_style | py::array::forcecast>;
          const Floats arr = source_factors.cast<Floats>();  // a copy where needed
          const size_t n = id_span.span().size();
          SSSD_CHECK_ARG(arr.ndim() == 3 && size_t(arr.shape(0)) == n && arr.shape(1) == sssd::kMaxSources &&
                             arr.shape(2) == 2,
                         "source_factors must have shape (", n, ", ", sssd::kMaxSources, ", 2)");
          const float* f = arr.data();
          factor_scale.resize(n * sssd::kMaxSources);
          factor_level.resize(n * sssd::kMaxSources);
          for (size_t i = 0; i < factor_scale.size(); ++i) {
            factor_scale[i] = f[2 * i];
            factor_level[i] = f[2 * i + 1];
          }
          factors = sssd::SourceFactors{factor_scale, factor_level};
        }
        // (RecentStore, source tag, int64 budgets [n]): the recent outputs asked in the same call.
        std::optional<sssd::RecentQuery> recent_query;
        std::optional<Borrowed<int64_t>> recent_budgets;
        if (!recent.is_none()) {
          if (!py::isinstance<py::tuple>(recent)) throw py::type_error("recent: expected a tuple (RecentStore, tag, budgets)");
          const auto t = recent.cast<py::tuple>();
          if (t.size() != 3 || !py::isinstance<sssd::RecentStore>(t[0]) || !py::isinstance<py::int_>(t[1])) {
            throw py::type_error("recent: expected (RecentStore, int tag, budgets array)");
          }
          recent_budgets.emplace(t[2].cast<py::array>(), "recent budgets");
          recent_query = sssd::RecentQuery{&t[0].cast<const sssd::RecentStore&>(), t[1].cast<int>(), *recent_budgets};
        }
        sssd::DraftBatch batch;
        {
          py::gil_scoped_release release;
          std::vector<sssd::DraftTree> trees;
          d.draft(id_span.span(), budget_span, trees, ext ? &*ext : nullptr, params, factors ? &*factors : nullptr,
                  recent_query ? &*recent_query : nullptr);
          batch = sssd::concat(trees);
        }
        return draft_batch_to_dict(std::move(batch));
      }, "request_ids"_a, "budgets"_a, "external"_a = py::none(), "params"_a = py::none(),
         "source_factors"_a = py::none(), "recent"_a = py::none(),
         "recent: (RecentStore, source tag, int64 budgets [n]) or None: the other requests' recent outputs, "
         "asked in this call for each request's own context (sssd::RecentQuery)")
      .def("check_compatible", &sssd::Drafter::check_compatible, "params"_a)
      .def("draft_context", [](const sssd::Drafter& d, const py::array& context, int budget) {
        const Tokens c(context, "prefix");
        sssd::DraftBatch batch;
        {
          py::gil_scoped_release release;
          batch = sssd::concat({d.draft_context(c.span(), budget)});
        }
        return draft_batch_to_dict(std::move(batch));
      }, "prefix"_a, "budget"_a);

  m.def("merge_trees", [](py::list trees, const sssd::ScoreTable& table, int budget) {
    // Builds each tree from parent-pointer arrays, then runs the merger.
    std::vector<sssd::ContinuationTree> owned(trees.size());
    std::vector<sssd::SourceTree> views;
    for (size_t i = 0; i < trees.size(); ++i) {
      py::dict t = trees[i].cast<py::dict>();
      const auto tok = borrow<sssd::token_t>(t["tokens"], "tokens");
      const auto par = borrow<int32_t>(t["parents"], "parents");
      const auto w = borrow<double>(t["weights"], "weights");
      const std::vector<float> weights(w.begin(), w.end());
      sssd::build_from_parents(owned[i], tok, par, weights, sssd::PathWeight::kAbsolute);
      const int source = t["source"].cast<int>();
      SSSD_CHECK_ARG(source >= 0 && source < sssd::kMaxSources, "unknown source ", source);
      sssd::SourceTree v = owned[i].view(sssd::Source(source), t["match_len"].cast<int>(),
                                         t["max_depth"].cast<int>());
      v.total = t["total"].cast<double>();
      SSSD_CHECK_ARG(v.total > 0, "tree ", i, ": total must be > 0");
      views.push_back(v);
    }
    SSSD_CHECK_ARG(budget >= 0 && budget <= sssd::kMaxBudget, "budget out of range");
    sssd::TreeMerger merger;
    sssd::DraftTree out;
    merger.merge(views, table, budget, out);
    return draft_batch_to_dict(sssd::concat({out}));
  }, "trees"_a, "table"_a, "budget"_a,
     "Runs the merge on explicit trees (dicts of tokens, parents, weights, total, source, "
     "match_len, max_depth). For tests and experiments.");

  m.def("best_chains", [](const py::array& offsets, const py::array& parents, const py::array& scores) {
    const auto off = borrow<int64_t>(offsets, "offsets");
    const auto par = borrow<int32_t>(parents, "parents");
    const auto sc = borrow<float>(scores, "scores");
    std::pair<std::vector<int64_t>, std::vector<int32_t>> chains;
    {
      py::gil_scoped_release release;
      chains = sssd::best_chains(off, par, sc);
    }
    return py::make_tuple(to_numpy(std::move(chains.first)), to_numpy(std::move(chains.second)));
  }, "offsets"_a, "parents"_a, "scores"_a,
     "Per tree, the chain with the largest sum of scores (request-local node indices).");
}
