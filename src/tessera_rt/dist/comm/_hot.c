/* The plain collectives' plan-hit path in C (issue 17: within 1 us of the raw mpi4py call).
 *
 * dist.all_reduce & co. stay Python functions (collectives.py): they build plans, check
 * input, raise the errors, run the hooks, the GPU and async paths.  `Collective` wraps one
 * of them.  A call on a C-contiguous NumPy array whose plan is already cached, over a group
 * already made, with no hooks on and a direct mpi4py call in its plan (`plan.hot`), runs
 * here: the same steps as the Python function's direct path, in the same order, without the
 * interpreter's per-bytecode cost.  Anything else -- a miss, a DTensor, CuPy, a bad `out=`,
 * a strided input -- is handed to the Python function before anything has happened, so
 * errors and the other paths are the Python ones, written once.
 *
 * The agreement check's remembered-site path (consistency.check_plan) is done here too; its
 * other paths call check_plan(plan, 1): 1 because this wrapper adds no Python frame, so the
 * user's frame is check_plan's caller.  What the check and the watchers are comes from one
 * object, the seam (dist/hooks.py SEAM): its check_plan / check slots (None: off), its
 * agreement (the check's ring, verify and config) and its watchers list; this file reads no
 * module's globals.  From the check to the end of the MPI call,
 * `pending()` names the plan and a call number, for the watchdog (it reads the main
 * thread's frames, and this path leaves none of its own).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stddef.h>

/* The leading fields of a NumPy array object (numpy's PyArrayObject_fields: part of its ABI,
 * unchanged from 1.7 through 2.x, which every compiled extension relies on).  Read only for
 * objects whose type is exactly the ndarray type setup() was given, and only after setup()
 * has checked them against a probe array (layout_ok); otherwise every call goes to Python. */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
    PyObject *weakreflist;
} NpArray;
#define NP_C_CONTIGUOUS 0x0001
#define NP_OWNDATA 0x0004
static PyTypeObject *NDARRAY;
static int layout_ok;

enum { K_ALL_REDUCE, K_REDUCE_SCATTER, K_ALL_GATHER, K_ALL_TO_ALL, K_BROADCAST, K_N };
#define MAXP 16
#define OUT_GIVEN (-2)
#define MEMO_DIMS 8

/* what setup() hands over, read live each call: the plan table, the seam (SEAM) and its
 * watchers list (a slot never rebound: changed in place) */
static PyObject *PLANS, *CLEARS, *ROUTES, *SEAM, *HOOKS, *ROLE_STREAMS, *WORKER_TYPE, *IN_PLACE;
static PyObject *CURRENT_MESHES, *DEFAULT_MESH, *WORLD_GROUP;     /* mesh.mesh_stacks(), [world group] */
/* the seam's agreement last seen (SEAM.agreement) and its fields: an Agreement is never
 * changed, so its identity says whether these are current */
static PyObject *AGREEMENT, *CHECK_PLAN, *RING, *VERIFY, *CFG;
/* the C-path call in progress, from its check to the end of its MPI call (borrowed: the
 * call holds them), for the watchdog; a call inside one (none today) saves and restores it */
typedef struct {
    PyObject *plan, *x;
    unsigned long thread;
    unsigned long long n;
} Pending;
static Pending pending;
static unsigned long long n_calls;

static PyObject *S_groups, *S_hot, *S_nbytes, *S_site, *S_seq, *S_metas,
    *S_mask, *S_done, *S_issued, *S_wait_tasks, *S_axes, *S_world, *S_check_plan, *S_agreement, *S_ring,
    *S_verify, *S_cfg, *ONE;

/* The seam's agreement check for the C path: 1 when on (CHECK_PLAN, RING, VERIFY, CFG are its
 * fields), 0 when off, -1 when the check is not the agreement's (someone else's check_plan:
 * hand the call to Python) or on an error. */
static int agreement(void) {
    PyObject *chk = PyObject_GetAttr(SEAM, S_check_plan);
    if (chk == NULL) return -1;
    Py_DECREF(chk);                                  /* (the seam holds it) */
    if (chk == Py_None) return 0;
    PyObject *a = PyObject_GetAttr(SEAM, S_agreement);
    if (a == NULL) return -1;
    if (a != AGREEMENT) {
        PyObject *f[4] = {NULL, NULL, NULL, NULL}, *names[4] = {S_check_plan, S_ring, S_verify, S_cfg};
        for (int i = 0; i < 4 && a != Py_None; i++)
            if ((f[i] = PyObject_GetAttr(a, names[i])) == NULL) break;
        if (f[3] == NULL) {
            for (int i = 0; i < 4; i++) Py_XDECREF(f[i]);
            Py_DECREF(a);
            return -1;
        }
        Py_XSETREF(AGREEMENT, a);                    /* (takes the reference) */
        Py_XSETREF(CHECK_PLAN, f[0]); Py_XSETREF(RING, f[1]); Py_XSETREF(VERIFY, f[2]); Py_XSETREF(CFG, f[3]);
    } else {
        Py_DECREF(a);
    }
    return chk == CHECK_PLAN ? 1 : -1;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fallback;          /* the Python collective */
    PyObject *name;              /* its op name: the plan key's first element */
    PyObject *params;            /* parameter names after x, positional ones first */
    PyObject *defaults;          /* their defaults */
    PyObject *dict;
    int kind;
    Py_ssize_t npos, np, nkey, nnone;
    Py_ssize_t key[MAXP];        /* parameter index per key element after (op, id(g), cls, shape, dtype) */
    Py_ssize_t none[4];          /* parameters that must be None for this path */
    Py_ssize_t i_axis, i_mesh, i_out, i_role, i_root;
    unsigned long long hits;
    /* the last plan found, with what its key was made of: a repeat skips building and hashing
     * the key.  The pointers are borrowed: the key in PLANS holds them while the plan is
     * there, which m_clears (plans._CLEARS when it was found) vouches for. */
    PyObject *m_plan, *m_g, *m_type, *m_descr, *m_extra[MAXP];
    int m_nd;
    Py_ssize_t m_dims[MEMO_DIMS], m_clears;
    /* small outputs of m_plan handed out before (owned): one nobody else refers to any more
     * is the next output, as the raw call's caller reuses its buffer (a `y = op(x)` loop
     * frees every other one) */
    PyObject *m_out[2];
} Collective;

static Py_ssize_t param_index(Collective *c, PyObject *name) {
    for (Py_ssize_t i = 0; i < c->np; i++)
        if (PyTuple_GET_ITEM(c->params, i) == name) return i;
    for (Py_ssize_t i = 0; i < c->np; i++) {
        int eq = PyUnicode_Compare(PyTuple_GET_ITEM(c->params, i), name);
        if (eq == 0) return i;
        if (eq == -1 && PyErr_Occurred()) { PyErr_Clear(); return -1; }
    }
    return -1;
}

static Py_ssize_t named(Collective *c, const char *s) {
    PyObject *name = PyUnicode_InternFromString(s);
    if (name == NULL) { PyErr_Clear(); return -1; }
    Py_ssize_t i = param_index(c, name);
    Py_DECREF(name);
    return i;
}

/* consistency.check_plan's remembered-site path, else check_plan itself; 0 ok, -1 error (a
 * disagreement raised).  st: the plan's group state. */
static int verified_site(PyObject *site, PyObject *st);
static int verified_site_key(PyObject *st, PyObject *site);

/* frame f is at the call site (code, lasti): its code object and instruction offset */
static int at_site(PyFrameObject *f, PyObject *code, PyObject *lasti) {
    PyCodeObject *c = PyFrame_GetCode(f);
    Py_DECREF(c);                                    /* (the frame keeps it) */
#if PY_VERSION_HEX >= 0x030B0000
    long at = PyFrame_GetLasti(f);
#else
    PyObject *l = PyObject_GetAttrString((PyObject *)f, "f_lasti");
    long at = l == NULL ? -1 : PyLong_AsLong(l);
    Py_XDECREF(l);
#endif
    int same = (PyObject *)c == code && PyLong_CheckExact(lasti) && PyLong_AsLong(lasti) == at;
    PyErr_Clear();
    return same;
}

static int check(PyObject *p, PyObject *st) {
    PyObject *site = PyObject_GetAttr(p, S_site);
    if (site == NULL) return -1;
    int rc = 1;                                      /* 1: not settled here */
    if (PyTuple_Check(site) && PyTuple_GET_SIZE(site) == 0)
        rc = 0;                                      /* consistency.ALONE: a group of one */
    else if (PyTuple_Check(site) && PyTuple_GET_SIZE(site) >= 2)
        rc = verified_site(site, st);
    Py_DECREF(site);
    if (rc != 1) return rc;
    PyObject *args[2] = {p, ONE};          /* depth 1: the user's frame is check_plan's caller */
    PyObject *r = PyObject_Vectorcall(CHECK_PLAN, args, 2, NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* The caller's frame is the remembered site and no DTensor metadata is pending: count the
 * call, note it in the ring, verify the sampled one.  1 if the site does not apply. */
static int verified_site(PyObject *site, PyObject *st) {
    PyObject *metas = PyObject_GetAttr(CFG, S_metas);
    int busy = metas == NULL ? -1 : PyObject_IsTrue(metas);
    Py_XDECREF(metas);
    if (busy) return busy < 0 ? -1 : 1;
    PyFrameObject *f = PyEval_GetFrame();
    if (f == NULL || !at_site(f, PyTuple_GET_ITEM(site, 0), PyTuple_GET_ITEM(site, 1))) return 1;
    return verified_site_key(st, site);
}

/* One call of a verified key on a group: count it, ring it, verify the sampled one.  0 ok,
 * -1 error (a disagreement raised). */
static int verified_site_key(PyObject *st, PyObject *site) {
    PyObject *old = PyObject_GetAttr(st, S_seq), *seq = NULL, *rec = NULL, *r = NULL, *mask = NULL;
    int rc = -1;
    long long n = old == NULL ? 0 : PyLong_AsLongLong(old) + 1;
    Py_XDECREF(old);
    if (PyErr_Occurred() || (seq = PyLong_FromLongLong(n)) == NULL || PyObject_SetAttr(st, S_seq, seq) < 0)
        goto done;
    if ((rec = PyTuple_Pack(3, st, seq, site)) == NULL || (r = PyObject_CallOneArg(RING, rec)) == NULL)
        goto done;
    Py_CLEAR(r);
    if ((mask = PyObject_GetAttr(CFG, S_mask)) == NULL) goto done;
    long long m = PyLong_AsLongLong(mask);
    if (PyErr_Occurred()) goto done;
    if (!(n & m)) {                                  /* the sampled call: verify with the peers */
        if ((r = PyObject_CallFunctionObjArgs(VERIFY, st, seq, site, NULL)) == NULL) goto done;
        Py_CLEAR(r);
    }
    rc = 0;
done:
    if (rc < 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "tessera_rt.dist._hot: the seam's agreement failed");
    Py_XDECREF(seq); Py_XDECREF(rec); Py_XDECREF(mask);
    return rc;
}

/* The NumPy arrays this path takes: exactly the ndarray type (the fields above are read
 * directly), C-contiguous; anything else goes to the Python function. */
static int plain_array(PyObject *a) {
    return layout_ok && Py_TYPE(a) == NDARRAY && (((NpArray *)a)->flags & NP_C_CONTIGUOUS);
}

static PyObject *array_shape(NpArray *n) {          /* x.shape, a new reference */
    PyObject *t = PyTuple_New(n->nd);
    for (int i = 0; t != NULL && i < n->nd; i++) {
        PyObject *d = PyLong_FromSsize_t(n->dimensions[i]);
        if (d == NULL) { Py_CLEAR(t); break; }
        PyTuple_SET_ITEM(t, i, d);
    }
    return t;
}

/* o is a plain array of exactly the shape ps (a tuple of ints) and the dtype pd */
static int out_fits(PyObject *o, PyObject *ps, PyObject *pd) {
    if (!plain_array(o) || !PyTuple_Check(ps)) return 0;
    NpArray *n = (NpArray *)o;
    if (n->nd != PyTuple_GET_SIZE(ps)) return 0;
    for (int i = 0; i < n->nd; i++)
        if (PyLong_AsSsize_t(PyTuple_GET_ITEM(ps, i)) != n->dimensions[i]) { PyErr_Clear(); return 0; }
    int ok = n->descr == pd || PyObject_RichCompareBool(n->descr, pd, Py_EQ) == 1;
    PyErr_Clear();
    return ok;
}

static PyObject *key_arg(Collective *c, PyObject **v, Py_ssize_t i) {
    return c->key[i] == OUT_GIVEN ? (v[c->i_out] == Py_None ? Py_False : Py_True) : v[c->key[i]];
}

static Py_ssize_t clears(void) {
    return PyLong_AsSsize_t(PyList_GET_ITEM(CLEARS, 0));
}

/* x (an ndarray) over g with these arguments is what the memo was made of */
static int memo_hit(Collective *c, NpArray *x, PyObject *g, PyObject **v) {
    if (c->m_plan == NULL || g != c->m_g || x->descr != c->m_descr || x->nd != c->m_nd || Py_TYPE(x) != (PyTypeObject *)c->m_type)
        return 0;
    for (int i = 0; i < x->nd; i++)
        if (x->dimensions[i] != c->m_dims[i]) return 0;
    for (Py_ssize_t i = 0; i < c->nkey; i++)
        if (key_arg(c, v, i) != c->m_extra[i]) return 0;
    return c->m_clears == clears();
}

static void memo_keep(Collective *c, PyObject *p, NpArray *x, PyObject *g, PyObject **v) {
    Py_INCREF(p);
    Py_XSETREF(c->m_plan, p);
    Py_CLEAR(c->m_out[0]);
    Py_CLEAR(c->m_out[1]);
    c->m_g = g;
    c->m_type = (PyObject *)Py_TYPE(x);
    c->m_descr = x->descr;
    c->m_nd = x->nd;
    for (int i = 0; i < x->nd; i++) c->m_dims[i] = x->dimensions[i];
    for (Py_ssize_t i = 0; i < c->nkey; i++) c->m_extra[i] = key_arg(c, v, i);
    c->m_clears = clears();
}

/* The plan the Python function would find for the plain array x: the same key in the same
 * dict (a new reference, or NULL with no error set). */
static PyObject *find_plan(Collective *c, PyObject *x, PyObject *g, PyObject **v) {
    int memo = ((NpArray *)x)->nd <= MEMO_DIMS;
    if (memo && memo_hit(c, (NpArray *)x, g, v)) {
        Py_INCREF(c->m_plan);
        return c->m_plan;
    }
    PyObject *key = PyTuple_New(5 + c->nkey), *p = NULL;
    if (key == NULL) return NULL;
    Py_INCREF(c->name);
    PyTuple_SET_ITEM(key, 0, c->name);
    PyTuple_SET_ITEM(key, 1, PyLong_FromVoidPtr(g));                   /* id(g) */
    Py_INCREF(Py_TYPE(x));
    PyTuple_SET_ITEM(key, 2, (PyObject *)Py_TYPE(x));
    PyTuple_SET_ITEM(key, 3, array_shape((NpArray *)x));
    Py_INCREF(((NpArray *)x)->descr);
    PyTuple_SET_ITEM(key, 4, ((NpArray *)x)->descr);
    for (Py_ssize_t i = 0; i < c->nkey; i++) {
        PyObject *k = key_arg(c, v, i);
        Py_INCREF(k);
        PyTuple_SET_ITEM(key, 5 + i, k);
    }
    if (PyTuple_GET_ITEM(key, 1) && PyTuple_GET_ITEM(key, 3)) {
        p = PyDict_GetItemWithError(PLANS, key);          /* (unhashable arguments: an error) */
        Py_XINCREF(p);
    }
    Py_DECREF(key);
    PyErr_Clear();
    if (p != NULL && memo) memo_keep(c, p, (NpArray *)x, g, v);
    return p;
}

#define REUSE_MAX_BYTES (64 << 10)     /* larger outputs go back to the pool when freed */

/* an earlier output of plan p that only this object refers to (a new reference), or NULL */
static PyObject *reuse_out(Collective *c, PyObject *p) {
    if (p != c->m_plan) return NULL;
    for (int i = 0; i < 2; i++) {
        PyObject *o = c->m_out[i];
        if (o != NULL && Py_REFCNT(o) == 1 && ((NpArray *)o)->weakreflist == NULL) {   /* (keep_out) */
            Py_INCREF(o);
            return o;
        }
    }
    return NULL;
}

static void keep_out(Collective *c, PyObject *p, PyObject *out) {
    /* only an array that owns its memory: every view of it then refers to it (a view of a
     * pool block's array refers to the block), so its count says whether anyone can see it */
    if (p != c->m_plan || !plain_array(out) || !(((NpArray *)out)->flags & NP_OWNDATA)) return;
    PyObject *nb = PyObject_GetAttr(out, S_nbytes);
    Py_ssize_t n = nb == NULL ? -1 : PyLong_AsSsize_t(nb);
    Py_XDECREF(nb);
    PyErr_Clear();
    if (n < 0 || n > REUSE_MAX_BYTES) return;
    int i = c->m_out[0] == NULL ? 0 : c->m_out[1] == NULL ? 1 : Py_REFCNT(c->m_out[0]) > 1;   /* both held: the other */
    Py_INCREF(out);
    Py_XSETREF(c->m_out[i], out);
}

/* work.resolve_group's hot path: the axis group of mesh (None: the current mesh, or the
 * world group with no mesh at all), if it has been made (borrowed: the mesh holds it).
 * NULL (no error set): let the Python function find or make it. */
static PyObject *group_of(PyObject *mesh, PyObject *axis) {
    if (mesh == Py_None) {
        Py_ssize_t n = PyList_GET_SIZE(CURRENT_MESHES);
        mesh = n ? PyList_GET_ITEM(CURRENT_MESHES, n - 1)
                 : PyList_GET_SIZE(DEFAULT_MESH) ? PyList_GET_ITEM(DEFAULT_MESH, 0) : NULL;
        if (mesh == NULL) {
            int world = axis == Py_None || (PyUnicode_Check(axis) && PyUnicode_Compare(axis, S_world) == 0);
            return world && PyList_GET_SIZE(WORLD_GROUP) ? PyList_GET_ITEM(WORLD_GROUP, 0) : NULL;
        }
    }
    PyObject *axes = NULL, *g = NULL, *groups = PyObject_GetAttr(mesh, S_groups);
    if (groups != NULL && PyDict_Check(groups)) {
        if (axis == Py_None) {                       /* every axis; the only one of a 1-d mesh */
            axes = PyObject_GetAttr(mesh, S_axes);
            if (axes != NULL && PyTuple_Check(axes) && PyTuple_GET_SIZE(axes) > 0)
                axis = PyTuple_GET_SIZE(axes) == 1 ? PyTuple_GET_ITEM(axes, 0) : axes;
        }
        if (axis != Py_None) g = PyDict_GetItemWithError(groups, axis);
    }
    Py_XDECREF(groups);
    Py_XDECREF(axes);
    PyErr_Clear();
    return g;
}

static PyObject *collective_call(Collective *c, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *v[MAXP], *p = NULL, *hot = NULL, *out = NULL, *send = NULL, *res;
    Pending outer;
    if (nargs < 1 || nargs > 1 + c->npos || PyList_GET_SIZE(HOOKS) != 0) goto fallback;
    PyObject *x = args[0];
    if (!plain_array(x)) goto fallback;          /* CuPy, a DTensor, a strided view, a list, ... */
    for (Py_ssize_t i = 0; i < c->np; i++)
        v[i] = i < nargs - 1 ? args[i + 1] : PyTuple_GET_ITEM(c->defaults, i);
    if (kwnames != NULL) {
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(kwnames); k++) {
            Py_ssize_t i = param_index(c, PyTuple_GET_ITEM(kwnames, k));
            if (i < nargs - 1) goto fallback;       /* unknown, or given twice: Python's TypeError */
            v[i] = args[nargs + k];
        }
    }
    PyObject *g = group_of(v[c->i_mesh], v[c->i_axis]);
    if (g == NULL) goto fallback;
    for (Py_ssize_t i = 0; i < c->nnone; i++)
        if (v[c->none[i]] != Py_None) goto fallback;
    if (PyDict_Contains(ROUTES, (PyObject *)Py_TYPE(x)) != 0) goto fallback;     /* (a registered ndarray) */

    /* everything that sends the call to Python is decided before anything happens */
    if ((p = find_plan(c, x, g, v)) == NULL) goto fallback;
    hot = PyObject_GetAttr(p, S_hot);         /* (fn, mop, st, empty, shape, dtype, pack) or None */
    if (hot == NULL || !PyTuple_CheckExact(hot) || PyTuple_GET_SIZE(hot) != 7) goto fallback;
    PyObject *fn = PyTuple_GET_ITEM(hot, 0), *mop = PyTuple_GET_ITEM(hot, 1), *st = PyTuple_GET_ITEM(hot, 2);
    PyObject *pack = PyTuple_GET_ITEM(hot, 6);
    if (c->kind != K_BROADCAST && v[c->i_out] != Py_None) {
        if (!out_fits(v[c->i_out], PyTuple_GET_ITEM(hot, 4), PyTuple_GET_ITEM(hot, 5)))
            goto fallback;                          /* Python names what out= must be */
        out = v[c->i_out];
        Py_INCREF(out);
    }
    int chk = agreement();
    if (chk < 0) goto fallback;

    /* from here on this is the call: errors are raised, not handed over */
    c->hits++;
    outer = pending;
    pending.plan = p;
    pending.x = x;
    pending.thread = PyThread_get_thread_ident();
    pending.n = ++n_calls;
    if (chk && check(p, st) < 0) goto error;
    if (c->kind != K_BROADCAST && out == NULL && (out = reuse_out(c, p)) == NULL) {
        PyObject *a[2] = {PyTuple_GET_ITEM(hot, 4), PyTuple_GET_ITEM(hot, 5)};
        if ((out = PyObject_Vectorcall(PyTuple_GET_ITEM(hot, 3), a, 2, NULL)) == NULL) goto error;
        keep_out(c, p, out);
    }
    PyObject *s = PyDict_GetItemWithError(ROLE_STREAMS, v[c->i_role]);     /* stream order */
    if (s == NULL && PyErr_Occurred()) goto error;
    if (s != NULL && (PyObject *)Py_TYPE(s) == WORKER_TYPE) {
        PyObject *d = PyObject_GetAttr(s, S_done), *is = d ? PyObject_GetAttr(s, S_issued) : NULL;
        int behind = is ? PyObject_RichCompareBool(d, is, Py_NE) : -1;
        Py_XDECREF(d); Py_XDECREF(is);
        if (behind < 0) goto error;
        if (behind) {
            PyObject *w = PyObject_CallMethodNoArgs(s, S_wait_tasks);
            if (w == NULL) goto error;
            Py_DECREF(w);
        }
    }
    if (pack != Py_None && (send = PyObject_CallOneArg(pack, x)) == NULL) goto error;  /* split dim != 0 */
    PyObject *a[3] = {send ? send : x, out, mop};
    Py_ssize_t na = 2;
    if (c->kind == K_ALL_REDUCE || c->kind == K_REDUCE_SCATTER) {
        if (c->kind == K_ALL_REDUCE && x == out) a[0] = IN_PLACE;
        na = 3;
    } else if (c->kind == K_BROADCAST) {
        a[1] = v[c->i_root];
    }
    res = PyObject_Vectorcall(fn, a, na, NULL);
    pending = outer;
    Py_CLEAR(send);
    if (res == NULL) goto error;
    Py_DECREF(res);
    Py_DECREF(hot);
    Py_DECREF(p);
    if (c->kind == K_BROADCAST) {
        Py_INCREF(x);
        return x;
    }
    return out;

error:
    pending = outer;
    Py_XDECREF(send); Py_XDECREF(out); Py_XDECREF(hot); Py_XDECREF(p);
    return NULL;
fallback:
    PyErr_Clear();                  /* the Python function meets it again and says what */
    Py_XDECREF(out); Py_XDECREF(hot); Py_XDECREF(p);
    return PyObject_Vectorcall(c->fallback, args, nargsf, kwnames);
}

static PyObject *collective_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return collective_call((Collective *)self, args, nargsf, kwnames);
}

/* Collective(kind, fallback, key, none): key lists the parameter names that follow
 * (op, id(group), type, shape, dtype) in the Python function's plan key ("out is not None" for
 * that test); none lists the parameters that must be None for this path. */
static PyObject *collective_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    int kind;
    PyObject *fallback, *keyspec, *nonespec;
    if (!PyArg_ParseTuple(args, "iOO!O!", &kind, &fallback, &PyTuple_Type, &keyspec, &PyTuple_Type, &nonespec))
        return NULL;
    if (kind < 0 || kind >= K_N) return PyErr_Format(PyExc_ValueError, "unknown collective kind %d", kind);
    PyObject *code = PyObject_GetAttrString(fallback, "__code__");
    if (code == NULL) return NULL;
    PyCodeObject *co = (PyCodeObject *)code;
    Py_ssize_t npos = co->co_argcount - 1, np = co->co_argcount + co->co_kwonlyargcount - 1;
    PyObject *names = PyObject_GetAttrString(code, "co_varnames");
    Py_DECREF(code);
    if (names == NULL) return NULL;
    if (np < 1 || np > MAXP || PyTuple_GET_SIZE(keyspec) > MAXP - 5 || PyTuple_GET_SIZE(nonespec) > 4) {
        Py_DECREF(names);
        return PyErr_Format(PyExc_ValueError, "collective signature too large");
    }
    Collective *c = (Collective *)type->tp_alloc(type, 0);
    if (c == NULL) { Py_DECREF(names); return NULL; }
    c->vectorcall = collective_vectorcall;
    c->kind = kind;
    c->npos = npos;
    c->np = np;
    Py_INCREF(fallback);
    c->fallback = fallback;
    c->params = PyTuple_GetSlice(names, 1, np + 1);
    Py_DECREF(names);
    c->defaults = PyTuple_New(np);
    c->name = PyObject_GetAttrString(fallback, "__name__");
    c->dict = PyDict_New();
    PyObject *pos_def = PyObject_GetAttrString(fallback, "__defaults__");
    PyObject *kw_def = PyObject_GetAttrString(fallback, "__kwdefaults__");
    if (c->params == NULL || c->defaults == NULL || c->name == NULL || c->dict == NULL || pos_def == NULL ||
        kw_def == NULL)
        goto fail;
    Py_ssize_t ndef = pos_def == Py_None ? 0 : PyTuple_GET_SIZE(pos_def);
    if (ndef != npos) { PyErr_SetString(PyExc_ValueError, "every parameter after x needs a default"); goto fail; }
    for (Py_ssize_t i = 0; i < np; i++) {
        PyObject *name = PyTuple_GET_ITEM(c->params, i), *d;
        if (i < npos) d = PyTuple_GET_ITEM(pos_def, i);
        else if ((d = kw_def == Py_None ? NULL : PyDict_GetItemWithError(kw_def, name)) == NULL) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "every parameter after x needs a default");
            goto fail;
        }
        Py_INCREF(d);
        PyTuple_SET_ITEM(c->defaults, i, d);
    }
    c->i_axis = named(c, "axis");
    c->i_mesh = named(c, "mesh");
    c->i_out = named(c, "out");
    c->i_role = named(c, "role");
    c->i_root = named(c, "root");
    if (c->i_axis < 0 || c->i_mesh < 0 || c->i_role < 0 || (kind == K_BROADCAST ? c->i_root : c->i_out) < 0) {
        PyErr_SetString(PyExc_ValueError, "a collective takes axis, mesh, role and out (broadcast: root)");
        goto fail;
    }
    c->nkey = PyTuple_GET_SIZE(keyspec);
    for (Py_ssize_t i = 0; i < c->nkey; i++) {
        PyObject *k = PyTuple_GET_ITEM(keyspec, i);
        int is_out = PyUnicode_Check(k) && PyUnicode_CompareWithASCIIString(k, "out is not None") == 0;
        c->key[i] = is_out ? OUT_GIVEN : param_index(c, k);
        if (c->key[i] == -1) { PyErr_Format(PyExc_ValueError, "no parameter %R", k); goto fail; }
    }
    c->nnone = PyTuple_GET_SIZE(nonespec);
    for (Py_ssize_t i = 0; i < c->nnone; i++) {
        c->none[i] = param_index(c, PyTuple_GET_ITEM(nonespec, i));
        if (c->none[i] < 0) { PyErr_Format(PyExc_ValueError, "no parameter %R", PyTuple_GET_ITEM(nonespec, i)); goto fail; }
    }
    Py_DECREF(pos_def);
    Py_DECREF(kw_def);
    return (PyObject *)c;                   /* (tp_alloc has started tracking it) */
fail:
    Py_XDECREF(pos_def);
    Py_XDECREF(kw_def);
    Py_DECREF(c);
    return NULL;
}

static int collective_traverse(Collective *c, visitproc visit, void *arg) {
    Py_VISIT(c->fallback);
    Py_VISIT(c->dict);
    Py_VISIT(c->defaults);
    Py_VISIT(c->m_plan);
    Py_VISIT(c->m_out[0]);
    Py_VISIT(c->m_out[1]);
    return 0;
}

static int collective_clear(Collective *c) {
    Py_CLEAR(c->fallback);
    Py_CLEAR(c->dict);
    Py_CLEAR(c->defaults);
    Py_CLEAR(c->params);
    Py_CLEAR(c->name);
    Py_CLEAR(c->m_plan);
    Py_CLEAR(c->m_out[0]);
    Py_CLEAR(c->m_out[1]);
    return 0;
}

static void collective_dealloc(Collective *c) {
    PyObject_GC_UnTrack(c);
    collective_clear(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *collective_repr(Collective *c) {
    return PyUnicode_FromFormat("<tessera_rt collective %U>", c->name);
}

static PyObject *collective_hits(Collective *c, void *closure) {
    return PyLong_FromUnsignedLongLong(c->hits);
}

static PyGetSetDef collective_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {"hits", (getter)collective_hits, NULL, "calls that took the C path", NULL},
    {NULL},
};

static PyTypeObject CollectiveType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tessera_rt.dist._hot.Collective",
    .tp_basicsize = sizeof(Collective),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "A plain collective with its plan-hit path in C (see _hot.c).",
    .tp_new = collective_new,
    .tp_dealloc = (destructor)collective_dealloc,
    .tp_traverse = (traverseproc)collective_traverse,
    .tp_clear = (inquiry)collective_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Collective, vectorcall),
    .tp_dictoffset = offsetof(Collective, dict),
    .tp_repr = (reprfunc)collective_repr,
    .tp_getset = collective_getset,
};

/* The probe: a non-contiguous 2-d view whose shape, strides and dtype setup() was told. */
static int check_layout(PyObject *probe, PyObject *shape, PyObject *descr) {
    if (Py_TYPE(probe) != NDARRAY || !PyTuple_Check(shape)) return 0;
    NpArray *n = (NpArray *)probe;
    if (n->nd != PyTuple_GET_SIZE(shape) || n->descr != descr) return 0;
    for (int i = 0; i < n->nd; i++)
        if (n->dimensions[i] != PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i))) return 0;
    PyErr_Clear();
    return (n->flags & NP_C_CONTIGUOUS) == 0 && NDARRAY->tp_weaklistoffset == offsetof(NpArray, weakreflist);
}

static PyObject *setup(PyObject *self, PyObject *args) {
    PyObject *o[10], *ndarray, *probe, *probe_shape, *probe_dtype;
    if (!PyArg_ParseTuple(args, "O!O!O!OO!OOO!O!O!O!OO!O", &PyDict_Type, &o[0], &PyList_Type, &o[1], &PyDict_Type,
                          &o[2], &o[3], &PyDict_Type, &o[4], &o[5], &o[6], &PyList_Type, &o[7], &PyList_Type, &o[8],
                          &PyList_Type, &o[9], &PyType_Type, &ndarray, &probe, &PyTuple_Type, &probe_shape,
                          &probe_dtype))
        return NULL;
    if (PyList_GET_SIZE(o[1]) != 1 || !PyLong_Check(PyList_GET_ITEM(o[1], 0)))
        return PyErr_Format(PyExc_ValueError, "plans._CLEARS must be [int]");
    PyObject *watchers = PyObject_GetAttrString(o[3], "watchers");
    if (watchers == NULL) return NULL;
    if (!PyList_Check(watchers)) {
        Py_DECREF(watchers);
        return PyErr_Format(PyExc_TypeError, "the seam's watchers must be a list");
    }
    Py_XSETREF(HOOKS, watchers);
    Py_INCREF(ndarray);
    Py_XSETREF(NDARRAY, (PyTypeObject *)ndarray);
    layout_ok = check_layout(probe, probe_shape, probe_dtype);
    PyObject **dst[10] = {&PLANS, &CLEARS, &ROUTES, &SEAM, &ROLE_STREAMS, &WORKER_TYPE, &IN_PLACE, &CURRENT_MESHES,
                          &DEFAULT_MESH, &WORLD_GROUP};
    for (int i = 0; i < 10; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*dst[i], o[i]);
    }
    return PyBool_FromLong(layout_ok);
}

/* ---------------------------------------------------------------- compiled redistributions
 *
 * run_compiled(plan, x, depth[, out]): redistribute.RedistributionPlan.run's repeat path -- its guard (the
 * compiled form's array type, dtype and shape), consistency.check_run's remembered-site
 * path, then the compiled function (given ``out``, the caller's buffer for the result, when
 * passed) -- for a plain array with nothing watching collectives.  The compiled function is
 * the plan's one executor (dist/compiled_plan.py), the same RedistributionPlan.run calls: this adds no
 * description of the steps of its own.  NotImplemented (before anything has happened) when
 * any of it does not apply, and the caller runs RedistributionPlan.run.  depth: the caller's frame as check_run
 * counts (1: RedistributionPlan.run itself, 2: RedistributionPlan.run's caller). */
static PyObject *S_exec, *S_verified, *S_check;
static unsigned long long compiled_hits;

static PyObject *run_compiled(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 && nargs != 4) return PyErr_Format(PyExc_TypeError, "run_compiled(plan, x, depth[, out])");
    PyObject *plan = args[0], *x = args[1], *ex = NULL, *v = NULL, *res = NULL;
    if (PyList_GET_SIZE(HOOKS) != 0 || !plain_array(x)) Py_RETURN_NOTIMPLEMENTED;
    NpArray *n = (NpArray *)x;
    ex = PyObject_GetAttr(plan, S_exec);             /* (type, dtype, shape, fn, checks) or None */
    if (ex == NULL || !PyTuple_CheckExact(ex) || PyTuple_GET_SIZE(ex) != 5) goto not_here;
    PyObject *shape = PyTuple_GET_ITEM(ex, 2);
    if ((PyObject *)Py_TYPE(x) != PyTuple_GET_ITEM(ex, 0) || n->descr != PyTuple_GET_ITEM(ex, 1) ||
        !PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) != n->nd)
        goto not_here;
    for (int i = 0; i < n->nd; i++)
        if (PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i)) != n->dimensions[i]) goto not_here;
    PyObject *chk = PyObject_GetAttr(SEAM, S_check);
    if (chk == NULL) goto not_here;
    Py_DECREF(chk);                                  /* (the seam holds it) */
    if (chk != Py_None) {
        if (agreement() != 1) goto not_here;
        /* plan._verified: (depth from check_run, code, lasti, ((group state, key), ...)) */
        v = PyObject_GetAttr(plan, S_verified);
        if (v == NULL || !PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 4 || !PyTuple_Check(PyTuple_GET_ITEM(v, 3)))
            goto not_here;
        PyObject *metas = PyObject_GetAttr(CFG, S_metas);
        int busy = metas == NULL ? -1 : PyObject_IsTrue(metas);
        Py_XDECREF(metas);
        if (busy != 0) goto not_here;
        long depth = PyLong_AsLong(PyTuple_GET_ITEM(v, 0)) - PyLong_AsLong(args[2]);
        PyFrameObject *f = PyEval_GetFrame();
        Py_XINCREF(f);
        for (long i = 0; f != NULL && i < depth; i++) {
            PyFrameObject *back = PyFrame_GetBack(f);
            Py_DECREF(f);
            f = back;
        }
        if (f == NULL || PyErr_Occurred()) { Py_XDECREF(f); goto not_here; }
        int same = at_site(f, PyTuple_GET_ITEM(v, 1), PyTuple_GET_ITEM(v, 2));
        Py_DECREF(f);
        if (!same || PyErr_Occurred()) goto not_here;
        /* the run is this verified site's: count each collective, ring it, verify the sampled */
        PyObject *pairs = PyTuple_GET_ITEM(v, 3);
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(pairs); i++) {
            PyObject *pair = PyTuple_GET_ITEM(pairs, i);
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
                PyErr_SetString(PyExc_RuntimeError, "tessera_rt.dist._hot: a malformed plan._verified");
                goto error;
            }
            if (verified_site_key(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)) < 0) goto error;
        }
    }
    compiled_hits++;
    PyObject *a[2] = {x, nargs == 4 ? args[3] : NULL};
    res = PyObject_Vectorcall(PyTuple_GET_ITEM(ex, 3), a, nargs == 4 ? 2 : 1, NULL);
    Py_DECREF(ex);
    Py_XDECREF(v);
    return res;
not_here:
    PyErr_Clear();
    Py_XDECREF(ex);
    Py_XDECREF(v);
    Py_RETURN_NOTIMPLEMENTED;
error:
    Py_XDECREF(ex);
    Py_XDECREF(v);
    return NULL;
}

static PyObject *get_compiled_hits(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(compiled_hits);
}

static PyObject *get_pending(PyObject *self, PyObject *unused) {
    if (pending.plan == NULL) Py_RETURN_NONE;
    return Py_BuildValue("(KOOk)", pending.n, pending.plan, pending.x, pending.thread);
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(plans, plans_clears, routes, seam, role_streams, worker_stream_type, in_place, current_meshes, "
     "default_mesh, world_group, ndarray, probe, probe_shape, probe_dtype) -> whether the array fields are read "
     "directly"},
    {"run_compiled", (PyCFunction)(void (*)(void))run_compiled, METH_FASTCALL,
     "run_compiled(plan, x, depth[, out]): redistribute.RedistributionPlan.run's repeat path, or NotImplemented"},
    {"compiled_hits", get_compiled_hits, METH_NOARGS, "runs run_compiled took"},
    {"pending", get_pending, METH_NOARGS,
     "(call number, plan, x, thread ident) of the C-path collective in progress, or None"},
    {NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hot", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hot(void) {
    if (PyType_Ready(&CollectiveType) < 0) return NULL;
#define INTERN(var, s) if ((var = PyUnicode_InternFromString(s)) == NULL) return NULL
    INTERN(S_groups, "_groups"); INTERN(S_exec, "_exec"); INTERN(S_verified, "_verified"); INTERN(S_check, "check"); INTERN(S_nbytes, "nbytes");
    INTERN(S_hot, "hot"); INTERN(S_axes, "axes"); INTERN(S_world, "world"); INTERN(S_site, "site");
    INTERN(S_seq, "seq"); INTERN(S_metas, "metas"); INTERN(S_mask, "mask");
    INTERN(S_done, "_done"); INTERN(S_issued, "_issued"); INTERN(S_wait_tasks, "wait_tasks");
    INTERN(S_check_plan, "check_plan"); INTERN(S_agreement, "agreement"); INTERN(S_ring, "ring");
    INTERN(S_verify, "verify"); INTERN(S_cfg, "cfg");
    if ((ONE = PyLong_FromLong(1)) == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CollectiveType);
    if (PyModule_AddObject(m, "Collective", (PyObject *)&CollectiveType) < 0) return NULL;
    PyModule_AddIntConstant(m, "ALL_REDUCE", K_ALL_REDUCE);
    PyModule_AddIntConstant(m, "REDUCE_SCATTER", K_REDUCE_SCATTER);
    PyModule_AddIntConstant(m, "ALL_GATHER", K_ALL_GATHER);
    PyModule_AddIntConstant(m, "ALL_TO_ALL", K_ALL_TO_ALL);
    PyModule_AddIntConstant(m, "BROADCAST", K_BROADCAST);
    return m;
}
