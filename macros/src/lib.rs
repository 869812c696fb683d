//! Attribute macros for [toma](https://docs.rs/toma). Use them through the `toma` crate
//! (`#[toma::batch]`, `#[toma::range]`, `#[toma::chunked]`); their documentation lives there.
//!
//! Each attribute parses its arguments, checks the signature, and rewrites the function into a
//! call of toma's builders (`toma::Batch`, `toma::Range`, `toma::Chunked`) through
//! `toma::__private`. Mistakes become compile errors at the offending tokens, emitted next to
//! the unchanged function so that the rest of the crate still type-checks.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote, quote_spanned, ToTokens};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, FnArg, ItemFn, Lit, MetaNameValue, Pat, PatType, ReturnType, Token, Type};

mod module;
mod tensor_methods;

/// Internal to toma (its lazy op families): generates the panicking twins and the family's
/// tensor-method trait from an `impl LazyTensor` block. See `tensor_methods.rs`.
#[doc(hidden)]
#[proc_macro_attribute]
pub fn tensor_methods(args: TokenStream, item: TokenStream) -> TokenStream {
    tensor_methods::expand(args.into(), item.into()).unwrap_or_else(syn::Error::into_compile_error).into()
}

/// `#[toma::lazy::module]`: one `forward` (or `forward_t`) body for tch's `Module` (`ModuleT`)
/// and toma's lazy one. Documented at its re-export, `toma::lazy::module`.
#[proc_macro_attribute]
pub fn module(args: TokenStream, item: TokenStream) -> TokenStream {
    module::expand(args.into(), item.into()).unwrap_or_else(syn::Error::into_compile_error).into()
}

/// Retries the function with a halved batch size on out-of-memory. See `toma::batch`.
#[proc_macro_attribute]
pub fn batch(args: TokenStream, item: TokenStream) -> TokenStream {
    expand(Op::Batch, args.into(), item.into()).into()
}

/// Runs the function over sub-ranges of `[start, end)`, halving the step on out-of-memory.
/// See `toma::range`.
#[proc_macro_attribute]
pub fn range(args: TokenStream, item: TokenStream) -> TokenStream {
    expand(Op::Range, args.into(), item.into()).into()
}

/// Runs the function on chunks of a tensor, halving the chunk on out-of-memory.
/// See `toma::chunked`.
#[proc_macro_attribute]
pub fn chunked(args: TokenStream, item: TokenStream) -> TokenStream {
    expand(Op::Chunked, args.into(), item.into()).into()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Batch,
    Range,
    Chunked,
}

impl Op {
    fn attribute(self) -> &'static str {
        match self {
            Op::Batch => "#[toma::batch]",
            Op::Range => "#[toma::range]",
            Op::Chunked => "#[toma::chunked]",
        }
    }

    fn size_argument(self) -> &'static str {
        match self {
            Op::Batch => "initial_batchsize",
            Op::Range | Op::Chunked => "initial_step",
        }
    }

    fn allowed(self) -> &'static [&'static str] {
        match self {
            Op::Batch => &["initial_batchsize", "cache", "policy", "crate"],
            Op::Range => &[
                "initial_step",
                "cache",
                "policy",
                "budget",
                "safety_margin",
                "max_step",
                "objective",
                "progress",
                "crate",
            ],
            Op::Chunked => &[
                "initial_step",
                "dimension",
                "cache",
                "policy",
                "budget",
                "safety_margin",
                "max_step",
                "objective",
                "progress",
                "crate",
            ],
        }
    }

    /// The leading parameters the function must have, as (name, expected type) for messages.
    fn leading(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Op::Batch => &[("batchsize", "usize")],
            Op::Range => &[("start", "usize"), ("end", "usize")],
            Op::Chunked => &[("chunk", "Tensor"), ("start", "usize"), ("end", "usize")],
        }
    }

    fn signature_hint(self) -> &'static str {
        match self {
            Op::Batch => "fn f(batchsize: usize, ..)",
            Op::Range => "fn f(start: usize, end: usize, ..)",
            Op::Chunked => "fn f(chunk: Tensor, start: usize, end: usize, ..)",
        }
    }
}

/// The parsed arguments of an attribute.
struct Args {
    size: Expr,
    dimension: Option<Expr>,
    cache: Option<syn::Ident>,
    policy: Option<TokenStream2>,
    /// `initial_step = auto`: the step comes from measurement.
    auto: bool,
    /// The `auto` options and `progress` as builder calls (`.budget(..)`, ..).
    auto_options: TokenStream2,
    /// The path toma is reached by (`crate = path`, for a crate that re-exports toma);
    /// `::toma` by default.
    krate: TokenStream2,
}

fn expand(op: Op, args: TokenStream2, item: TokenStream2) -> TokenStream2 {
    let function: ItemFn = match syn::parse2(item.clone()) {
        Ok(function) => function,
        Err(err) => {
            let message = format!("{} applies to a function", op.attribute());
            return with_original(syn::Error::new(err.span(), message), item);
        }
    };
    match parse_args(op, args) {
        Ok(args) => rewrite(op, &args, &function).unwrap_or_else(|error| with_original(error, item)),
        Err(error) => with_placeholder(op, error, &function, item),
    }
}

/// An argument error, and the function as it will be once the arguments are fixed (with a
/// placeholder size), as tokio-macros does: callers then see the signature they will get and
/// no second error at every call site. Chunked keeps the original: its expansion needs tch.
fn with_placeholder(op: Op, error: syn::Error, function: &ItemFn, item: TokenStream2) -> TokenStream2 {
    if op == Op::Chunked {
        return with_original(error, item);
    }
    let placeholder = Args {
        size: syn::parse_quote!(1usize),
        dimension: None,
        cache: None,
        policy: None,
        auto: false,
        auto_options: TokenStream2::new(),
        krate: quote!(::toma),
    };
    match rewrite(op, &placeholder, function) {
        Ok(tokens) => {
            let error = error.to_compile_error();
            quote!(#error #tokens)
        }
        Err(mut signature) => {
            signature.combine(error);
            with_original(signature, item)
        }
    }
}

/// The error, and the function as the user wrote it, so that IDEs and the rest of the crate
/// keep working while the error is fixed.
fn with_original(error: syn::Error, item: TokenStream2) -> TokenStream2 {
    let error = error.to_compile_error();
    quote!(#error #item)
}

fn parse_args(op: Op, args: TokenStream2) -> syn::Result<Args> {
    let pairs = Punctuated::<MetaNameValue, Token![,]>::parse_terminated.parse2(args.clone())?;
    // `crate = path` first: the other arguments' expansions name toma through it.
    let mut krate = None;
    for pair in &pairs {
        if pair.path.is_ident("crate") {
            if krate.is_some() {
                return Err(syn::Error::new(pair.path.span(), "`crate` is given more than once"));
            }
            let Expr::Path(path) = &pair.value else {
                return Err(syn::Error::new(
                    pair.value.span(),
                    "`crate` takes a path, such as `crate = my_crate::toma`",
                ));
            };
            krate = Some(path.to_token_stream());
        }
    }
    let krate = krate.unwrap_or_else(|| quote!(::toma));
    let mut size = None;
    let mut dimension = None;
    let mut cache = None;
    let mut policy = None;
    let mut auto = false;
    let mut auto_options = TokenStream2::new();
    let mut option_spans = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for pair in pairs.into_iter().filter(|pair| !pair.path.is_ident("crate")) {
        let name = pair.path.get_ident().map(|i| i.to_string()).unwrap_or_default();
        if !op.allowed().contains(&name.as_str()) {
            let expected = op.allowed().iter().map(|a| format!("`{a}`")).collect::<Vec<_>>().join(", ");
            return Err(syn::Error::new(
                pair.path.span(),
                format!(
                    "unknown argument `{}` for {}; expected {expected}",
                    pair.path.to_token_stream(),
                    op.attribute()
                ),
            ));
        }
        if !seen.insert(name.clone()) {
            return Err(syn::Error::new(pair.path.span(), format!("`{name}` is given more than once")));
        }
        let p = quote!(#krate::__private);
        match name.as_str() {
            "initial_step" if is_ident(&pair.value, "auto") => {
                auto = true;
                size = Some(syn::parse_quote!(1usize));
            }
            "initial_batchsize" | "initial_step" => size = Some(positive_size(&name, pair.value)?),
            "dimension" => dimension = Some(dimension_value(pair.value)?),
            "policy" => policy = Some(policy_value(pair.value, &krate)?),
            "budget" | "safety_margin" | "max_step" => {
                let method = format_ident!("{}", name);
                let value = if name == "safety_margin" { pair.value } else { positive_size(&name, pair.value)? };
                option_spans.push((name.clone(), value.span()));
                auto_options.extend(quote_spanned!(value.span()=> .#method(#value)));
            }
            "objective" => {
                let value = if is_ident(&pair.value, "largest") {
                    quote!(#p::Objective::Largest)
                } else if is_ident(&pair.value, "fastest") {
                    quote!(#p::Objective::Fastest)
                } else {
                    pair.value.to_token_stream()
                };
                option_spans.push((name.clone(), pair.value.span()));
                auto_options.extend(quote!(.objective(#value)));
            }
            "progress" => {
                // `true`/`false`, `terminal`/`always`/`off`, or any `impl Into<toma::Progress>`.
                let value = match &pair.value {
                    v if is_ident(v, "terminal") => quote!(#p::Progress::Terminal),
                    v if is_ident(v, "always") => quote!(#p::Progress::Always),
                    v if is_ident(v, "off") => quote!(#p::Progress::Off),
                    v => v.to_token_stream(),
                };
                auto_options.extend(quote_spanned!(pair.value.span()=> .progress(#value)));
            }
            _ => cache = Some(cache_kind(pair.value)?),
        }
    }
    if let (false, Some((name, span))) = (auto, option_spans.first()) {
        return Err(syn::Error::new(*span, format!("`{name}` is an option of `initial_step = auto`")));
    }
    let size = size.ok_or_else(|| {
        let span = if args.is_empty() { Span::call_site() } else { args.span() };
        let auto = if op == Op::Batch { "" } else { ", or `auto` to size it from measured memory" };
        syn::Error::new(
            span,
            format!("{} needs `{} = N` (the size to try first, at least 1{auto})", op.attribute(), op.size_argument()),
        )
    })?;
    Ok(Args { size, dimension, cache, policy, auto, auto_options, krate })
}

fn is_ident(value: &Expr, name: &str) -> bool {
    matches!(value, Expr::Path(path) if path.qself.is_none() && path.path.is_ident(name))
}

/// An integer literal ≥ 1, or any other expression (checked at run time).
fn positive_size(name: &str, value: Expr) -> syn::Result<Expr> {
    if let Expr::Lit(ExprLit { lit, .. }) = &value {
        let Lit::Int(int) = lit else {
            return Err(syn::Error::new(lit.span(), format!("`{name}` takes an integer, such as `{name} = 64`")));
        };
        let n: u128 = int.base10_parse()?;
        if n == 0 {
            return Err(syn::Error::new(
                int.span(),
                format!("`{name}` must be at least 1: a size of 0 could never run"),
            ));
        }
    }
    Ok(value)
}

fn dimension_value(value: Expr) -> syn::Result<Expr> {
    let literal = match &value {
        Expr::Lit(ExprLit { lit, .. }) => Some(lit),
        Expr::Unary(syn::ExprUnary { op: syn::UnOp::Neg(_), expr, .. }) => match expr.as_ref() {
            Expr::Lit(ExprLit { lit, .. }) => Some(lit),
            _ => None,
        },
        _ => None,
    };
    match literal {
        Some(Lit::Int(_)) | None => Ok(value),
        Some(other) => Err(syn::Error::new(other.span(), "`dimension` takes an integer, such as `dimension = 1`")),
    }
}

fn cache_kind(value: Expr) -> syn::Result<syn::Ident> {
    const KINDS: [&str; 3] = ["StacktraceMemory", "Global", "None"];
    if let Expr::Path(path) = &value {
        if let Some(last) = path.path.segments.last() {
            if KINDS.contains(&last.ident.to_string().as_str()) && last.arguments.is_empty() {
                return Ok(last.ident.clone());
            }
        }
    }
    Err(syn::Error::new(value.span(), "`cache` is one of `StacktraceMemory`, `Global` or `None`"))
}

/// `halve`, `grow`, `factor(0.9)`, `grow_up_to(4096)` name `toma::Policy` constructors; any
/// other expression must be a `toma::Policy`. A literal factor outside (0, 1) is rejected here.
fn policy_value(value: Expr, krate: &TokenStream2) -> syn::Result<TokenStream2> {
    const SHORT: [&str; 4] = ["halve", "grow", "factor", "grow_up_to"];
    let short = |path: &syn::ExprPath| {
        path.qself.is_none()
            && path.path.segments.len() == 1
            && SHORT.contains(&path.path.segments[0].ident.to_string().as_str())
    };
    let p = quote!(#krate::__private::Policy);
    match &value {
        Expr::Path(path) if short(path) => {
            let name = &path.path.segments[0].ident;
            if name == "factor" || name == "grow_up_to" {
                return Err(syn::Error::new(name.span(), format!("`{name}` takes an argument, such as `{name}(..)`")));
            }
            Ok(quote_spanned!(name.span()=> #p::#name()))
        }
        Expr::Call(call) if matches!(call.func.as_ref(), Expr::Path(path) if short(path)) => {
            if let (Expr::Path(path), Some(Expr::Lit(ExprLit { lit: Lit::Float(f), .. }))) =
                (call.func.as_ref(), call.args.first())
            {
                let factor: f64 = f.base10_parse()?;
                if path.path.segments[0].ident == "factor" && !(factor > 0.0 && factor < 1.0) {
                    return Err(syn::Error::new(f.span(), "a shrink factor must be strictly between 0 and 1"));
                }
            }
            let Expr::Path(path) = call.func.as_ref() else { unreachable!() };
            let name = &path.path.segments[0].ident;
            let args = &call.args;
            Ok(quote_spanned!(name.span()=> #p::#name(#args)))
        }
        other => Ok(other.to_token_stream()),
    }
}

/// The leading parameters, checked and taken out of the signature.
struct Leading {
    patterns: Vec<Pat>,
    types: Vec<Type>,
}

fn take_leading(op: Op, function: &ItemFn) -> syn::Result<Leading> {
    let receiver = usize::from(matches!(function.sig.inputs.first(), Some(FnArg::Receiver(_))));
    let wanted = op.leading();
    let typed: Vec<PatType> = function
        .sig
        .inputs
        .iter()
        .skip(receiver)
        .take(wanted.len())
        .filter_map(|arg| match arg {
            FnArg::Typed(typed) => Some(typed.clone()),
            FnArg::Receiver(_) => None,
        })
        .collect();
    if typed.len() < wanted.len() {
        let missing = &wanted[typed.len()];
        return Err(syn::Error::new(
            function.sig.paren_token.span.join(),
            format!(
                "{} needs the parameter `{}: {}` here: the function must look like `{}`",
                op.attribute(),
                missing.0,
                missing.1,
                op.signature_hint()
            ),
        ));
    }
    for (param, (name, ty)) in typed.iter().zip(wanted) {
        if !type_is(&param.ty, ty) {
            let position = wanted.iter().position(|w| w.0 == *name).map_or(0, |p| p + 1);
            return Err(syn::Error::new(
                param.ty.span(),
                format!(
                    "parameter {position} of a {} function must be `{name}: {ty}`: the function must look like `{}`",
                    op.attribute(),
                    op.signature_hint()
                ),
            ));
        }
        if let Pat::Ident(ident) = param.pat.as_ref() {
            if ident.by_ref.is_some() || ident.subpat.is_some() {
                return Err(syn::Error::new(param.pat.span(), "expected a plain parameter name"));
            }
        }
    }
    Ok(Leading {
        patterns: typed.iter().map(|p| (*p.pat).clone()).collect(),
        types: typed.iter().map(|p| (*p.ty).clone()).collect(),
    })
}

/// Whether `ty` is a path ending in `name` (`usize`, `Tensor`, `tch::Tensor`).
fn type_is(ty: &Type, name: &str) -> bool {
    match ty {
        Type::Path(path) => {
            path.qself.is_none() && path.path.segments.last().is_some_and(|s| s.ident == name && s.arguments.is_empty())
        }
        Type::Paren(inner) => type_is(&inner.elem, name),
        Type::Group(inner) => type_is(&inner.elem, name),
        _ => false,
    }
}

/// How the body's return type is handled.
enum Output {
    /// `Result<T, E>`: an `Err` that is an out-of-memory is retried.
    Result(Box<Type>),
    /// Any other type: only panics can be out-of-memories.
    Value(Box<Type>),
}

fn output(op: Op, function: &ItemFn) -> syn::Result<Output> {
    let ty: Box<Type> = match &function.sig.output {
        ReturnType::Default => Box::new(syn::parse_quote!(())),
        ReturnType::Type(_, ty) => ty.clone(),
    };
    if contains_impl_trait(&ty) {
        return Err(syn::Error::new(
            ty.span(),
            format!("{} cannot wrap a function returning `impl Trait`: name the type", op.attribute()),
        ));
    }
    if is_result(&ty) {
        return Ok(Output::Result(ty));
    }
    let unit = matches!(ty.as_ref(), Type::Tuple(t) if t.elems.is_empty());
    if op != Op::Batch && !unit {
        return Err(syn::Error::new(
            ty.span(),
            format!(
                "a {} function returns `()` or `Result<(), E>`: its sub-ranges have no value to give back",
                op.attribute()
            ),
        ));
    }
    Ok(Output::Value(ty))
}

/// `Result<..>` under any path (`std::result::Result`, `io::Result`, `tch::Result`, an alias
/// named `Result`): the engine then requires its error type to implement `OutOfMemory`.
fn is_result(ty: &Type) -> bool {
    match ty {
        Type::Path(path) => path.path.segments.last().is_some_and(|s| s.ident == "Result"),
        Type::Paren(inner) => is_result(&inner.elem),
        Type::Group(inner) => is_result(&inner.elem),
        _ => false,
    }
}

fn contains_impl_trait(ty: &Type) -> bool {
    ty.to_token_stream().into_iter().any(|t| matches!(&t, proc_macro2::TokenTree::Ident(i) if i == "impl"))
}

fn rewrite(op: Op, args: &Args, original: &ItemFn) -> syn::Result<TokenStream2> {
    if let Some(constness) = &original.sig.constness {
        return Err(syn::Error::new(constness.span(), format!("{} cannot wrap a `const fn`", op.attribute())));
    }
    let mut function = original.clone();
    let out = output(op, &function)?;
    let leading = take_leading(op, &function)?;
    let is_async = function.sig.asyncness.is_some();
    let receiver = usize::from(matches!(function.sig.inputs.first(), Some(FnArg::Receiver(_))));

    // The new signature: batch and chunked drop their leading parameters (chunked takes the
    // tensor instead); range keeps its own, renamed to plain identifiers.
    let kept: Vec<FnArg> = function.sig.inputs.iter().cloned().collect();
    let mut inputs: Punctuated<FnArg, Token![,]> = Punctuated::new();
    inputs.extend(kept[..receiver].iter().cloned());
    // Names the generated code gives the values it passes on; mixed-site hygiene keeps them
    // out of the body's sight, so they never clash with the user's names.
    let start_name = format_ident!("start", span = Span::mixed_site());
    let end_name = format_ident!("end", span = Span::mixed_site());
    let tensor_name = format_ident!("tensor", span = Span::mixed_site());
    match op {
        Op::Batch => {}
        Op::Range => {
            let ty = &leading.types[0];
            inputs.push(syn::parse_quote!(#start_name: #ty));
            let ty = &leading.types[1];
            inputs.push(syn::parse_quote!(#end_name: #ty));
        }
        Op::Chunked => {
            let ty = &leading.types[0];
            inputs.push(syn::parse_quote!(#tensor_name: &#ty));
        }
    }
    inputs.extend(kept[receiver + op.leading().len()..].iter().cloned());
    function.sig.inputs = inputs;

    let name = function.sig.ident.to_string();
    let size = &args.size;
    let size_span = size.span();
    let krate = &args.krate;
    let p = quote!(#krate::__private);
    let site = format_ident!("__TOMA_SITE", span = Span::mixed_site());
    let builder_expr = match op {
        Op::Batch => quote_spanned!(size_span=> #p::Batch::new(#size)),
        Op::Range if args.auto => quote_spanned!(size_span=> #p::Range::auto(#start_name, #end_name)),
        Op::Range => quote_spanned!(size_span=> #p::Range::new(#start_name, #end_name, #size)),
        Op::Chunked if args.auto => quote_spanned!(size_span=> #p::Chunked::auto(#tensor_name)),
        Op::Chunked => quote_spanned!(size_span=> #p::Chunked::new(#tensor_name, #size)),
    };
    let auto_options = &args.auto_options;
    let dimension = args.dimension.as_ref().map(|d| quote_spanned!(d.span()=> .dimension(#d)));
    let cache = args.cache.as_ref().map(|kind| quote_spanned!(kind.span()=> .cache(#p::CacheKind::#kind)));
    let policy = args.policy.as_ref().map(|policy| quote!(.policy(#policy)));
    let builder = quote!(#builder_expr #dimension #cache #policy #auto_options .site(&#site));

    let body = &function.block;
    let (ret, value_mode) = match &out {
        Output::Result(ty) => (ty, false),
        Output::Value(ty) => (ty, true),
    };
    let ret_span = ret.span();
    let pats = &leading.patterns;
    let tys = &leading.types;

    let new_body = if is_async {
        async_body(op, &p, &builder, pats, tys, body, ret, value_mode)
    } else {
        // The body becomes a closure, so `return` and `?` keep their meaning; its declared
        // return type makes inference and type errors point at the user's signature.
        let closure = if value_mode {
            quote!(|#(#pats: #tys),*| #p::infallible((|| -> #ret #body)()))
        } else {
            quote!(|#(#pats: #tys),*| -> #ret #body)
        };
        let run = quote_spanned!(ret_span=> run);
        let call = quote!(#builder.#run(#closure));
        if value_mode {
            quote!(#p::unwrap_infallible(#call))
        } else {
            call
        }
    };

    let attrs = &function.attrs;
    let vis = &function.vis;
    let sig = &function.sig;
    // `#[track_caller]` makes the cache key the user's call site; it has no effect on async
    // fns (rejected by a lint) and is not allowed on other ABIs.
    let track_caller = (!is_async && sig.abi.is_none()).then(|| quote!(#[track_caller]));
    Ok(quote! {
        #(#attrs)*
        #track_caller
        #vis #sig {
            static #site: #p::Site = #p::Site::new(
                ::core::concat!(::core::module_path!(), "::", #name),
                ::core::file!(),
                ::core::line!(),
            );
            #new_body
        }
    })
}

/// An async body cannot be a closure called many times (each future would have to own or
/// borrow the arguments), so the attempts are driven by a loop in the function itself, with
/// the body as a non-`move` async block awaited once per attempt.
#[allow(clippy::too_many_arguments)]
fn async_body(
    op: Op,
    p: &TokenStream2,
    builder: &TokenStream2,
    pats: &[Pat],
    tys: &[Type],
    body: &syn::Block,
    ret: &Type,
    value_mode: bool,
) -> TokenStream2 {
    let attempts = format_ident!("__toma_attempts", span = Span::mixed_site());
    let outcome = format_ident!("__toma_outcome", span = Span::mixed_site());
    // Every name the expansion binds around the body is mixed-site, so none shadows the user's
    // (a parameter called `next`, `result` or `err`).
    let next_value = format_ident!("next", span = Span::mixed_site());
    let result = format_ident!("result", span = Span::mixed_site());
    let err = format_ident!("err", span = Span::mixed_site());
    // `?` needs the block's output type fixed up front; a `()` body has no `?` to serve.
    let unit = matches!(ret, Type::Tuple(t) if t.elems.is_empty());
    let future = if unit { quote!(async #body) } else { quote!(#p::typed_future::<#ret, _>(async #body)) };
    let convert = value_mode.then(|| quote!(.map(#p::infallible)));
    let finish_ret = if value_mode { quote!(#p::unwrap_infallible(#result)) } else { quote!(#result) };
    match op {
        Op::Batch => {
            let pat = &pats[0];
            let ty = &tys[0];
            quote! {
                let mut #attempts = #builder.start();
                loop {
                    let #pat: #ty = #attempts.size();
                    let #outcome = #attempts.attempt_async(#future).await #convert;
                    if let #p::ControlFlow::Break(#result) = #attempts.finish(#outcome) {
                        return #finish_ret;
                    }
                }
            }
        }
        Op::Range | Op::Chunked => {
            let next = if op == Op::Range { quote!(next_range) } else { quote!(next_chunk) };
            let bind = quote!((#(#pats),*));
            let annotate = quote!((#(#tys),*));
            // A `()` body needs no final value: the loop is one.
            let done = if value_mode { quote!() } else { quote!(::core::result::Result::Ok(())) };
            quote! {
                let mut #attempts = #builder.start();
                while let ::core::option::Option::Some(#next_value) = #attempts.#next() {
                    let #bind: #annotate = #next_value;
                    let #outcome = #attempts.attempt_async(#future).await #convert;
                    if let ::core::result::Result::Err(#err) = #attempts.finish(#outcome) {
                        let #result = ::core::result::Result::Err(#err);
                        return #finish_ret;
                    }
                }
                #done
            }
        }
    }
}
