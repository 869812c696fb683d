//! `#[toma::lazy::module]` on a model's inherent `impl` or a free `fn` over `Tensor`s: each such
//! method's body in a hidden trait implemented for both tensor kinds, the method generic over
//! them (`generic_impl`, `generic_fn`). And on a custom layer's `impl Module for X { fn forward(&self, xs:
//! &Tensor) -> Tensor { .. } }` (or `impl ModuleT` with `forward_t(&self, xs: &Tensor, train:
//! bool)`): the one body serves tch's trait and toma's lazy one. The body is emitted twice,
//! once with `xs: &Tensor` and once with `xs: &LazyTensor`; tch's tensor methods have the same
//! names on both, so it type-checks for each (a `Tensor` named in a type annotation inside the
//! body does not, and the compiler says where).

use proc_macro2::TokenStream as TokenStream2;
use quote::quote;
use syn::visit_mut::VisitMut;
use syn::{FnArg, ImplItem, ItemImpl, Pat, ReturnType};

pub(crate) fn expand(args: TokenStream2, item: TokenStream2) -> syn::Result<TokenStream2> {
    if !args.is_empty() {
        return Err(syn::Error::new_spanned(args, "#[toma::lazy::module] takes no arguments"));
    }
    // An inherent `impl` or a free `fn` over `Tensor`s: made generic over both kinds.
    if let Ok(f) = syn::parse2::<syn::ItemFn>(item.clone()) {
        return generic_fn(f);
    }
    let block: ItemImpl = syn::parse2(item)?;
    if block.trait_.is_none() {
        return generic_impl(block);
    }
    let usage =
        "#[toma::lazy::module] goes on `impl Module for X { fn forward(&self, xs: &Tensor) -> Tensor { .. } }`, \
                 `impl ModuleT for X { fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor { .. } }`, \
                 an inherent `impl X { .. }` or a `fn` whose methods take or give `Tensor`s";
    if block.trait_.is_none() {
        return Err(syn::Error::new_spanned(&block.self_ty, usage));
    }
    let fns: Vec<_> = block
        .items
        .iter()
        .filter_map(|i| match i {
            ImplItem::Fn(f) => Some(f),
            _ => None,
        })
        .collect();
    let [f] = fns.as_slice() else {
        return Err(syn::Error::new_spanned(&block.self_ty, usage));
    };
    let train = match f.sig.ident.to_string().as_str() {
        "forward" => false,
        "forward_t" => true,
        _ => return Err(syn::Error::new_spanned(&f.sig.ident, usage)),
    };
    let args: Vec<&FnArg> = f.sig.inputs.iter().collect();
    let expected = if train { 3 } else { 2 };
    if args.len() != expected
        || !matches!(args[0], FnArg::Receiver(r) if r.reference.is_some() && r.mutability.is_none())
        || matches!(f.sig.output, ReturnType::Default)
    {
        return Err(syn::Error::new_spanned(&f.sig, usage));
    }
    let ident = |arg: &FnArg| match arg {
        FnArg::Typed(t) => match &*t.pat {
            Pat::Ident(p) => Ok(p.ident.clone()),
            other => Err(syn::Error::new_spanned(other, "a plain name is expected here")),
        },
        FnArg::Receiver(r) => Err(syn::Error::new_spanned(r, usage)),
    };
    let xs = ident(args[1])?;
    // tch's impl is written with the types and trait as the user wrote them, so that their
    // imports (`use tch::Tensor`, `use toma::lazy::nn::ModuleT`) are used, as without the
    // attribute.
    let ty_of = |arg: &FnArg| match arg {
        FnArg::Typed(t) => Ok(t.ty.clone()),
        FnArg::Receiver(r) => Err(syn::Error::new_spanned(r, usage)),
    };
    let xs_ty = ty_of(args[1])?;
    let output = &f.sig.output;
    let trait_path = &block.trait_.as_ref().expect("checked above").1;
    let uses = quote! {
        const _: () = {
            #[allow(dead_code)]
            fn the_trait_as_written<M: ?::std::marker::Sized + #trait_path>() {}
        };
    };
    let body = &eager_block(&f.block, &Pinned::default());
    let lazy_body = lazy_block(&f.block, &Pinned::default());
    let attrs = &f.attrs;
    let (impl_generics, _, where_clause) = block.generics.split_for_impl();
    let ty = &block.self_ty;
    let lazy = quote!(::toma::lazy::LazyTensor);
    let error = quote!(::toma::lazy::LazyError);
    Ok(if train {
        let flag = ident(args[2])?;
        let flag_ty = ty_of(args[2])?;
        quote! {
            #uses

            impl #impl_generics ::tch::nn::ModuleT for #ty #where_clause {
                #(#attrs)*
                fn forward_t(&self, #xs: #xs_ty, #flag: #flag_ty) #output #body
            }

            impl #impl_generics ::toma::lazy::nn::LazyModuleT for #ty #where_clause {
                #[allow(clippy::redundant_closure_call)]
                fn lazy_forward_t(&self, #xs: &#lazy, #flag: bool) -> ::std::result::Result<#lazy, #error> {
                    ::std::result::Result::Ok((|| -> #lazy #lazy_body)())
                }

                fn eager_forward_t(&self, xs: &::tch::Tensor, train: bool) -> ::std::option::Option<::tch::Tensor> {
                    ::std::option::Option::Some(::tch::nn::ModuleT::forward_t(self, xs, train))
                }
            }
        }
    } else {
        quote! {
            #uses

            impl #impl_generics ::tch::nn::Module for #ty #where_clause {
                #(#attrs)*
                fn forward(&self, #xs: #xs_ty) #output #body
            }

            impl #impl_generics ::toma::lazy::nn::LazyModule for #ty #where_clause {
                #[allow(clippy::redundant_closure_call)]
                fn lazy_forward(&self, #xs: &#lazy) -> ::std::result::Result<#lazy, #error> {
                    ::std::result::Result::Ok((|| -> #lazy #lazy_body)())
                }

                fn eager_forward(&self, xs: &::tch::Tensor) -> ::std::option::Option<::tch::Tensor> {
                    ::std::option::Option::Some(::tch::nn::Module::forward(self, xs))
                }
            }
        }
    })
}

/// The generic parameter that stands for the tensor kind in the methods made generic.
const KIND: &str = "__TomaTensor";

/// What rustc says, beside an argument that is no kind of tensor, about the usual cause.
const NOT_DEREFERENCED: &str =
    "a generic argument is not dereferenced: where the value is already a reference, pass it as it is (`x`, not `&x`)";

/// What a tensor kind names: the tensor, and tch's recurrent states that go with it.
struct Kinds {
    tensor: syn::Type,
    gru: syn::Type,
    lstm: syn::Type,
}

impl Kinds {
    /// The kinds of a generic parameter or `Self` (`kind`): its states through
    /// `toma::lazy::nn::RecurrentState`.
    fn of(kind: syn::Type) -> Kinds {
        let gru = syn::parse_quote!(<#kind as ::toma::lazy::nn::RecurrentState>::GRU);
        let lstm = syn::parse_quote!(<#kind as ::toma::lazy::nn::RecurrentState>::LSTM);
        Kinds { tensor: kind, gru, lstm }
    }

    fn lazy() -> Kinds {
        Kinds {
            tensor: syn::parse_quote!(::toma::lazy::LazyTensor),
            gru: syn::parse_quote!(::toma::lazy::nn::LazyGRUState),
            lstm: syn::parse_quote!(::toma::lazy::nn::LazyLSTMState),
        }
    }

    /// What replaces a type path ending in `name` (`Tensor`, `GRUState`, `LSTMState`).
    fn named(&self, name: &syn::Ident) -> Option<&syn::Type> {
        match name.to_string().as_str() {
            "Tensor" => Some(&self.tensor),
            "GRUState" => Some(&self.gru),
            "LSTMState" => Some(&self.lstm),
            _ => None,
        }
    }
}

/// Replaces every type path `Tensor`, `GRUState` or `LSTMState` (as written: `Tensor`,
/// `tch::Tensor`, `nn::GRUState`) in `ty` by what `with` names; whether one was.
fn replace_tensor(ty: &mut syn::Type, with: &Kinds) -> bool {
    use syn::{GenericArgument, PathArguments, Type};
    match ty {
        Type::Path(p) if p.qself.is_none() => {
            let last = p.path.segments.last().expect("a path has a segment");
            if let Some(kind) = with.named(&last.ident).filter(|_| matches!(last.arguments, PathArguments::None)) {
                *ty = kind.clone();
                return true;
            }
            let mut any = false;
            for seg in p.path.segments.iter_mut() {
                if let PathArguments::AngleBracketed(args) = &mut seg.arguments {
                    for arg in args.args.iter_mut() {
                        if let GenericArgument::Type(t) = arg {
                            any |= replace_tensor(t, with);
                        }
                    }
                }
            }
            any
        }
        Type::Reference(r) => replace_tensor(&mut r.elem, with),
        Type::Tuple(t) => t.elems.iter_mut().fold(false, |any, e| replace_tensor(e, with) | any),
        Type::Slice(s) => replace_tensor(&mut s.elem, with),
        Type::Array(a) => replace_tensor(&mut a.elem, with),
        Type::Paren(p) => replace_tensor(&mut p.elem, with),
        _ => false,
    }
}

/// A body as it runs on lazy values: the types it names (`let outs: Vec<Tensor>`, a state's
/// type) are the lazy ones; tch's `Tensor::cat` / `Tensor::stack` of lazy values is
/// `LazyTensor`'s; a layer's `zero_state` is its lazy one (`lazy_zero_state`). Expression paths
/// such as `Tensor::zeros(..)` or `Tensor::from_slice(..)` stay tch's: constants. Where a body
/// mixes the two, the elements of `Tensor::cat(&[..])` and the branches of an `if` that gives a
/// constant on one side become lazy operands (`toma::lazy::IntoLazy`), and a `let` whose value
/// is a constant keeps its `Tensor` annotation.
struct LazyBody(Kinds, Pinned);

/// Calls `self.name(..)` of this `impl`'s methods whose only `Tensor` is their result: in each
/// body they call the same body's kind (`<Self as Trait<Kind>>::name(self, ..)`), which the
/// arguments cannot tell.
#[derive(Clone, Default)]
struct Pinned {
    /// Each method's name and hidden trait.
    methods: Vec<(syn::Ident, syn::Ident)>,
}

impl Pinned {
    /// `call` pinned to `kind` when it is `self.name(..)` of a pinned method.
    fn pin(&self, call: &syn::ExprMethodCall, kind: &syn::Type) -> Option<syn::Expr> {
        let is_self = matches!(&*call.receiver, syn::Expr::Path(p) if p.path.is_ident("self"));
        let (name, tr) = self.methods.iter().find(|(name, _)| is_self && *name == call.method)?;
        let args = &call.args;
        Some(syn::parse_quote!(<Self as #tr<#kind>>::#name(self, #args)))
    }
}

/// A body as it runs on tch's tensors, as written but for what goes with the lazy one: `lazy(..)`
/// and `try_lazy(..)` give the tensors themselves (`toma::lazy::eager_wrap`), and calls of
/// methods pinned by kind ([`Pinned`]) call the `Tensor` one.
struct EagerBody(Pinned);

impl VisitMut for EagerBody {
    fn visit_expr_mut(&mut self, e: &mut syn::Expr) {
        syn::visit_mut::visit_expr_mut(self, e);
        if let syn::Expr::MethodCall(call) = e {
            if let Some(pinned) = self.0.pin(call, &syn::parse_quote!(::tch::Tensor)) {
                *e = pinned;
            }
        }
    }

    fn visit_expr_call_mut(&mut self, call: &mut syn::ExprCall) {
        syn::visit_mut::visit_expr_call_mut(self, call);
        if let syn::Expr::Path(f) = &mut *call.func {
            let last = f.path.segments.last().map(|s| s.ident.to_string());
            match last.as_deref() {
                Some("lazy") if f.qself.is_none() => f.path = syn::parse_quote!(::toma::lazy::eager_wrap),
                Some("try_lazy") if f.qself.is_none() => f.path = syn::parse_quote!(::toma::lazy::try_eager_wrap),
                _ => {}
            }
        }
    }
}

/// `block` as it runs on tch's tensors ([`EagerBody`]).
fn eager_block(block: &syn::Block, pinned: &Pinned) -> syn::Block {
    let mut block = block.clone();
    EagerBody(pinned.clone()).visit_block_mut(&mut block);
    block
}

/// Whether `e` is a tch constant made in the body: `Tensor::zeros(..)`, `Tensor::from_slice(..)`
/// and the like, and method chains on one (`Tensor::zeros(..).to_device(d)`).
fn constant_rooted(e: &syn::Expr) -> bool {
    match e {
        syn::Expr::Call(call) => match &*call.func {
            // Of the kind of its argument.
            syn::Expr::Path(_) if like_call(e).is_some() => call.args.first().is_some_and(constant_rooted),
            syn::Expr::Path(f) => {
                let s = &f.path.segments;
                let n = s.len();
                n >= 2 && s[n - 2].ident == "Tensor" && !is_list_op(&s[n - 1].ident)
            }
            _ => false,
        },
        syn::Expr::MethodCall(m) => constant_rooted(&m.receiver),
        syn::Expr::Paren(p) => constant_rooted(&p.expr),
        syn::Expr::Reference(r) => constant_rooted(&r.expr),
        syn::Expr::Block(b) => block_tail(&b.block).is_some_and(constant_rooted),
        _ => false,
    }
}

/// `Tensor::zeros_like(x, ..)` (any `*_like`, tch's methods over `&self`) as the method call
/// `(x).zeros_like(..)`, if `e` is one.
fn like_call(e: &syn::Expr) -> Option<syn::Expr> {
    let syn::Expr::Call(call) = e else { return None };
    let syn::Expr::Path(f) = &*call.func else { return None };
    let s = &f.path.segments;
    let n = s.len();
    let name = &s.last()?.ident;
    if n < 2 || s[n - 2].ident != "Tensor" || f.qself.is_some() || !name.to_string().ends_with("_like") {
        return None;
    }
    let mut args = call.args.iter();
    let receiver = args.next()?;
    let rest: Vec<&syn::Expr> = args.collect();
    Some(syn::parse_quote!((#receiver).#name(#(#rest),*)))
}

fn is_list_op(name: &syn::Ident) -> bool {
    matches!(name.to_string().as_str(), "cat" | "stack" | "f_cat" | "f_stack")
}

/// The value a block ends with, if it ends with one.
fn block_tail(b: &syn::Block) -> Option<&syn::Expr> {
    match b.stmts.last() {
        Some(syn::Stmt::Expr(e, None)) => Some(e),
        _ => None,
    }
}

fn block_tail_mut(b: &mut syn::Block) -> Option<&mut syn::Expr> {
    match b.stmts.last_mut() {
        Some(syn::Stmt::Expr(e, None)) => Some(e),
        _ => None,
    }
}

/// The values an `if` / `else if` / `else` chain ends with, each branch's.
fn if_tails(e: &mut syn::ExprIf) -> Vec<&mut syn::Expr> {
    let mut tails = Vec::new();
    let (then, rest) = (&mut e.then_branch, &mut e.else_branch);
    tails.extend(block_tail_mut(then));
    if let Some((_, other)) = rest {
        match &mut **other {
            syn::Expr::If(inner) => tails.extend(if_tails(inner)),
            syn::Expr::Block(b) => tails.extend(block_tail_mut(&mut b.block)),
            _ => {}
        }
    }
    tails
}

/// The name `let mut name = Tensor::..(..);` binds (no annotation, a tch constant), if `local`
/// is such a binding.
fn accumulator_name(local: &syn::Local) -> Option<&syn::Ident> {
    let syn::Pat::Ident(p) = &local.pat else { return None };
    let init = local.init.as_ref()?;
    (p.mutability.is_some() && p.by_ref.is_none() && tensor_rooted(&init.expr)).then_some(&p.ident)
}

/// A tch tensor the lazy body starts from: a constant it makes, or a field's tensor
/// (`self.decoder_start.shallow_clone()`, tch-rs's translation's first input).
fn tensor_rooted(e: &syn::Expr) -> bool {
    let field_clone = matches!(e, syn::Expr::MethodCall(m) if m.method == "shallow_clone"
        && matches!(&*m.receiver, syn::Expr::Field(f) if matches!(&*f.base, syn::Expr::Path(p) if p.path.is_ident("self"))));
    field_clone || constant_rooted(e)
}

/// In the lazy body, `name = if .. { a } else { b }` of an accumulator: each branch a lazy
/// operand, as the accumulator is (`prev = if teacher { target } else { output }`).
struct LazyAssigns<'a>(&'a [syn::Ident]);

impl VisitMut for LazyAssigns<'_> {
    fn visit_expr_assign_mut(&mut self, a: &mut syn::ExprAssign) {
        syn::visit_mut::visit_expr_assign_mut(self, a);
        let named = matches!(&*a.left, syn::Expr::Path(p) if self.0.iter().any(|n| p.path.is_ident(n)));
        if let (true, syn::Expr::If(e)) = (named, &mut *a.right) {
            if_tails(e).into_iter().for_each(into_lazy_owned);
        }
    }
}

/// Whether `stmt` assigns `name` something other than a tch constant (`name = name + term`,
/// `name += term`), anywhere within it.
fn takes_lazy_values(stmt: &syn::Stmt, name: &syn::Ident) -> bool {
    struct Finder<'a> {
        name: &'a syn::Ident,
        found: bool,
    }
    impl<'ast> syn::visit::Visit<'ast> for Finder<'_> {
        fn visit_expr(&mut self, e: &'ast syn::Expr) {
            let is_name = |e: &syn::Expr| matches!(e, syn::Expr::Path(p) if p.path.is_ident(self.name));
            let assigned = match e {
                syn::Expr::Assign(a) => is_name(&a.left) && !constant_rooted(&a.right),
                syn::Expr::Binary(b) => {
                    use syn::BinOp::*;
                    matches!(b.op, AddAssign(_) | SubAssign(_) | MulAssign(_) | DivAssign(_))
                        && is_name(&b.left)
                        && !constant_rooted(&b.right)
                }
                _ => false,
            };
            self.found |= assigned;
            syn::visit::visit_expr(self, e);
        }
    }
    let mut finder = Finder { name, found: false };
    syn::visit::Visit::visit_stmt(&mut finder, stmt);
    finder.found
}

/// `e`, a `Tensor` or a `LazyTensor` or a reference to one (a branch's value, an element of a
/// list for `Tensor::cat`), borrowed as a lazy operand.
fn into_lazy_owned(e: &mut syn::Expr) {
    let inner = e.clone();
    *e = syn::parse_quote!(::toma::lazy::IntoLazy::into_lazy(&(#inner)));
}

impl VisitMut for LazyBody {
    fn visit_type_mut(&mut self, ty: &mut syn::Type) {
        if !replace_tensor(ty, &self.0) {
            syn::visit_mut::visit_type_mut(self, ty);
        }
    }

    fn visit_block_mut(&mut self, block: &mut syn::Block) {
        // `let mut loss = Tensor::from(0f32);` then `loss = loss + term;` (tch-rs's translation
        // sums its loss so): an accumulator that starts as a constant and takes lazy values
        // later starts as a lazy operand.
        let accumulators: Vec<usize> = (0..block.stmts.len())
            .filter(|&i| match &block.stmts[i] {
                syn::Stmt::Local(local) => accumulator_name(local)
                    .is_some_and(|name| block.stmts[i + 1..].iter().any(|later| takes_lazy_values(later, name))),
                _ => false,
            })
            .collect();
        syn::visit_mut::visit_block_mut(self, block);
        let mut names = Vec::new();
        for &i in &accumulators {
            if let syn::Stmt::Local(syn::Local { pat: syn::Pat::Ident(p), init: Some(init), .. }) = &mut block.stmts[i]
            {
                into_lazy_owned(&mut init.expr);
                names.push(p.ident.clone());
            }
        }
        if let Some(&first) = accumulators.first() {
            let mut assigns = LazyAssigns(&names);
            block.stmts[first + 1..].iter_mut().for_each(|stmt| assigns.visit_stmt_mut(stmt));
        }
    }

    fn visit_local_mut(&mut self, local: &mut syn::Local) {
        // `let zeros: Tensor = Tensor::zeros(..)` is a constant: its annotation stays tch's.
        let constant = local.init.as_ref().is_some_and(|init| constant_rooted(&init.expr));
        if constant {
            if let syn::Pat::Type(t) = &mut local.pat {
                self.visit_pat_mut(&mut t.pat);
            } else {
                self.visit_pat_mut(&mut local.pat);
            }
            if let Some(init) = &mut local.init {
                self.visit_expr_mut(&mut init.expr);
            }
            return;
        }
        syn::visit_mut::visit_local_mut(self, local);
    }

    fn visit_expr_if_mut(&mut self, e: &mut syn::ExprIf) {
        // Branches that give a constant beside ones that give something else: all lazy.
        let kinds: Vec<bool> = if_tails(e).into_iter().map(|t| constant_rooted(t)).collect();
        let mixed = kinds.len() >= 2 && kinds.iter().any(|&c| c) && kinds.iter().any(|&c| !c);
        syn::visit_mut::visit_expr_if_mut(self, e);
        if mixed {
            if_tails(e).into_iter().for_each(into_lazy_owned);
        }
    }

    fn visit_expr_mut(&mut self, e: &mut syn::Expr) {
        if let syn::Expr::MethodCall(call) = e {
            if let Some(mut pinned) = self.1.pin(call, &syn::parse_quote!(::toma::lazy::LazyTensor)) {
                syn::visit_mut::visit_expr_mut(self, &mut pinned);
                *e = pinned;
                return;
            }
        }
        // `Tensor::randn_like(&x)`: tch's method called by its path, whose kind is its
        // argument's; as a method call it takes either kind.
        if let Some(method) = like_call(e) {
            *e = method;
        }
        syn::visit_mut::visit_expr_mut(self, e);
    }

    fn visit_expr_method_call_mut(&mut self, call: &mut syn::ExprMethodCall) {
        if call.method == "zero_state" {
            call.method = syn::Ident::new("lazy_zero_state", call.method.span());
        }
        // Not its turbofish: `binary_cross_entropy::<Tensor>(.., None, ..)` names the kind of
        // an absent weight, which stays tch's.
        self.visit_expr_mut(&mut call.receiver);
        for arg in call.args.iter_mut() {
            self.visit_expr_mut(arg);
        }
    }

    fn visit_expr_call_mut(&mut self, call: &mut syn::ExprCall) {
        if let syn::Expr::Path(f) = &mut *call.func {
            let segments = &f.path.segments;
            let n = segments.len();
            let of_lists = n >= 2 && segments[n - 2].ident == "Tensor" && is_list_op(&segments[n - 1].ident);
            if of_lists && f.qself.is_none() {
                let method = segments[n - 1].ident.clone();
                f.path = syn::parse_quote!(::toma::lazy::LazyTensor::#method);
                // A list written out may mix lazy values and constants (a `Tensor::zeros` pad):
                // each element becomes a lazy operand.
                syn::visit_mut::visit_expr_call_mut(self, call);
                // Owned values (`&[a, b]`, as tch's `Borrow<Tensor>` takes them), references and
                // names bound to references alike: each is borrowed once more.
                if let Some(syn::Expr::Reference(r)) = call.args.first_mut() {
                    if let syn::Expr::Array(list) = &mut *r.expr {
                        list.elems.iter_mut().for_each(into_lazy_owned);
                    }
                }
                return;
            }
        }
        syn::visit_mut::visit_expr_call_mut(self, call);
    }
}

/// `block` as it runs on lazy values ([`LazyBody`]).
fn lazy_block(block: &syn::Block, pinned: &Pinned) -> syn::Block {
    let mut block = block.clone();
    LazyBody(Kinds::lazy(), pinned.clone()).visit_block_mut(&mut block);
    block
}

/// Whether `sig` names a `Tensor` (or state) in its result only: its arguments cannot tell
/// which kind a call wants.
fn result_only(sig: &syn::Signature) -> bool {
    let mut args = sig.clone();
    args.output = ReturnType::Default;
    sig_with(&args, &Kinds::lazy()).is_none()
}

/// The lazy twin's name of a method whose only `Tensor` is its result: `lazy_` and its name, as
/// `zero_state` has `lazy_zero_state`.
fn lazy_twin(name: &syn::Ident) -> syn::Ident {
    quote::format_ident!("lazy_{}", name)
}

/// `sig` with its `Tensor`s (and states) replaced by `with`; `None` when it names none.
fn sig_with(sig: &syn::Signature, with: &Kinds) -> Option<syn::Signature> {
    let mut sig = sig.clone();
    let mut any = false;
    for arg in sig.inputs.iter_mut() {
        if let FnArg::Typed(t) = arg {
            any |= replace_tensor(&mut t.ty, with);
        }
    }
    if let ReturnType::Type(_, ty) = &mut sig.output {
        any |= replace_tensor(ty, with);
    }
    any.then_some(sig)
}

/// Whether `ty` is `&Tensor` (as written: `&Tensor`, `&tch::Tensor`).
fn is_tensor_ref(ty: &syn::Type) -> bool {
    let syn::Type::Reference(r) = ty else { return false };
    let syn::Type::Path(p) = &*r.elem else { return false };
    let last = p.path.segments.last().expect("a path has a segment");
    r.mutability.is_none() && p.qself.is_none() && last.ident == "Tensor" && last.arguments.is_none()
}

/// A wrapper whose first `&Tensor` argument picks the kind its body runs on and whose other
/// `&Tensor` arguments take either kind, where there are two or more and no other argument
/// names a tensor: a recorded feature map against a fixed target (`style_loss(&lazy, &tensor)`)
/// runs lazily, the `Tensor` a fixed operand (`toma::lazy::ArgOf`). The first argument's kind
/// is the result's as before, so a caller's `(0.99 * q).detach()` still infers. `sig` is the
/// signature as written, `call` makes the body's call from the kind and the arguments. `None`
/// for any other signature.
fn mixed_wrapper(
    sig: &syn::Signature,
    bound: impl Fn(&syn::Type) -> syn::WherePredicate,
    call: impl Fn(&syn::Type, Vec<TokenStream2>) -> TokenStream2,
) -> Option<(syn::Signature, syn::Block)> {
    let typed: Vec<&syn::PatType> = sig
        .inputs
        .iter()
        .filter_map(|a| match a {
            FnArg::Typed(t) => Some(t),
            FnArg::Receiver(_) => None,
        })
        .collect();
    let tensors = typed.iter().filter(|t| is_tensor_ref(&t.ty)).count();
    let others_name_tensors =
        typed.iter().any(|t| !is_tensor_ref(&t.ty) && replace_tensor(&mut t.ty.as_ref().clone(), &Kinds::lazy()));
    if tensors < 2 || others_name_tensors || !typed.iter().all(|t| matches!(&*t.pat, Pat::Ident(_))) {
        return None;
    }
    let mut wrapper = sig.clone();
    let kind: syn::Type = syn::parse_str(KIND).expect("an identifier");
    let mut others: Vec<syn::Ident> = Vec::new();
    let mut first: Option<syn::Ident> = None;
    let mut args = Vec::new();
    for arg in wrapper.inputs.iter_mut() {
        let FnArg::Typed(t) = arg else { continue };
        let Pat::Ident(name) = &*t.pat else { unreachable!("checked above") };
        let name = &name.ident;
        if !is_tensor_ref(&t.ty) {
            args.push(quote!(#name));
        } else if first.is_none() {
            *t.ty = syn::parse_quote!(&#kind);
            args.push(quote!(#name));
            first = Some(name.clone());
        } else {
            let other = quote::format_ident!("__TomaArg{}", others.len());
            *t.ty = syn::parse_quote!(&#other);
            args.push(quote!(&*<#kind as ::toma::lazy::ArgOf<#other>>::arg(#name, #first)));
            others.push(other);
        }
    }
    if let ReturnType::Type(_, ty) = &mut wrapper.output {
        replace_tensor(ty, &Kinds::of(kind.clone()));
    }
    wrapper.generics.params.push(syn::parse_quote!(#kind: ::toma::lazy::nn::RecurrentState));
    wrapper.generics.params.extend(others.iter().map(|k| -> syn::GenericParam { syn::parse_quote!(#k) }));
    let clause = wrapper.generics.make_where_clause();
    clause.predicates.push(bound(&kind));
    for other in &others {
        clause.predicates.push(syn::parse_quote!(#kind: ::toma::lazy::ArgOf<#other>));
    }
    let body = call(&kind, args);
    Some((wrapper, syn::parse_quote!({ #body })))
}

/// The names of `sig`'s arguments (besides `self`), to pass them on.
fn arg_names(sig: &syn::Signature) -> syn::Result<Vec<syn::Ident>> {
    sig.inputs
        .iter()
        .filter_map(|arg| match arg {
            FnArg::Typed(t) => Some(match &*t.pat {
                Pat::Ident(p) => Ok(p.ident.clone()),
                other => Err(syn::Error::new_spanned(other, "#[toma::lazy::module]: a plain name is expected here")),
            }),
            FnArg::Receiver(_) => None,
        })
        .collect()
}

/// A free `fn` over `Tensor`s: a hidden trait with the body once per tensor kind (the body as
/// written for tch's `Tensor`, and again for `LazyTensor`), and the `fn` itself generic over the
/// kinds, dispatching to it.
fn generic_fn(f: syn::ItemFn) -> syn::Result<TokenStream2> {
    let kind: syn::Type = syn::parse_str(KIND).expect("an identifier");
    let this: syn::Type = syn::parse_quote!(Self);
    let usage = "#[toma::lazy::module] on a fn: its arguments or result name `Tensor`";
    let Some(mut decl) = sig_with(&f.sig, &Kinds::of(this)) else {
        return Err(syn::Error::new_spanned(&f.sig, usage));
    };
    let lazy_sig = sig_with(&f.sig, &Kinds::lazy()).expect("it names a Tensor");
    let mut wrapper = sig_with(&f.sig, &Kinds::of(kind.clone())).expect("it names a Tensor");
    let name = &f.sig.ident;
    let trait_ident = quote::format_ident!("__TomaFn_{}", name);
    decl.ident = name.clone();
    wrapper.generics.params.push(syn::parse_quote!(#kind: #trait_ident));
    let args = arg_names(&f.sig)?;
    let (vis, attrs, sig) = (&f.vis, &f.attrs, &f.sig);
    let body = eager_block(&f.block, &Pinned::default());
    let lazy_body = lazy_block(&f.block, &Pinned::default());
    // Its result only names a `Tensor`: the caller's annotation picks the kind, or the lazy
    // twin names it.
    let twin = result_only(&f.sig).then(|| {
        let mut twin_sig = lazy_sig.clone();
        twin_sig.ident = lazy_twin(name);
        let doc = format!("`{name}` on lazy values, its kind named (`#[toma::lazy::module]`).");
        quote! {
            #[doc = #doc]
            #vis #twin_sig {
                <::toma::lazy::LazyTensor as #trait_ident>::#name(#(#args),*)
            }
        }
    });
    let not_a_kind = format!("`{{Self}}` is not a kind of tensor: `{name}` takes `&Tensor` or `&LazyTensor`");
    let not_dereferenced = NOT_DEREFERENCED;
    let mixed = mixed_wrapper(
        &f.sig,
        |joined| syn::parse_quote!(#joined: #trait_ident),
        |joined, args| quote!(<#joined as #trait_ident>::#name(#(#args),*)),
    );
    let call = match mixed {
        Some((mixed, block)) => quote!(#vis #mixed #block),
        None => quote!(#vis #wrapper { <#kind as #trait_ident>::#name(#(#args),*) }),
    };
    Ok(quote! {
        #[doc(hidden)]
        #[allow(non_camel_case_types)]
        #[diagnostic::on_unimplemented(message = #not_a_kind, note = #not_dereferenced)]
        pub trait #trait_ident: ::std::marker::Sized + ::toma::lazy::nn::RecurrentState {
            #decl;
        }
        impl #trait_ident for ::tch::Tensor {
            #sig #body
        }
        impl #trait_ident for ::toma::lazy::LazyTensor {
            #lazy_sig #lazy_body
        }
        #(#attrs)*
        #call
        #twin
    })
}

/// An inherent `impl` whose methods take or give `Tensor`s: each such method's body goes into a
/// hidden trait implemented once per tensor kind, and the method itself becomes generic over the
/// kinds, dispatching to it. Other methods stay as they are.
fn generic_impl(mut block: ItemImpl) -> syn::Result<TokenStream2> {
    let kind: syn::Type = syn::parse_str(KIND).expect("an identifier");
    let k: syn::Ident = syn::parse_str(KIND).expect("an identifier");
    let self_ty = block.self_ty.clone();
    let type_name = match &*self_ty {
        syn::Type::Path(p) => p.path.segments.last().map(|s| s.ident.to_string()).unwrap_or_default(),
        _ => String::new(),
    };
    let (impl_generics, _, where_clause) = block.generics.split_for_impl();
    let trait_of = |name: &syn::Ident| quote::format_ident!("__Toma{}_{}", type_name, name);
    // Methods whose only `Tensor` is their result: called as `self.name(..)` in a body, they
    // take that body's kind.
    let pinned = Pinned {
        methods: block
            .items
            .iter()
            .filter_map(|item| match item {
                ImplItem::Fn(f) if sig_with(&f.sig, &Kinds::lazy()).is_some() && result_only(&f.sig) => {
                    Some((f.sig.ident.clone(), trait_of(&f.sig.ident)))
                }
                _ => None,
            })
            .collect(),
    };
    let mut extra = TokenStream2::new();
    let mut twins: Vec<ImplItem> = Vec::new();
    for item in block.items.iter_mut() {
        let ImplItem::Fn(f) = item else { continue };
        let Some(decl) = sig_with(&f.sig, &Kinds::of(kind.clone())) else { continue };
        let lazy_sig = sig_with(&f.sig, &Kinds::lazy()).expect("it names a Tensor");
        let name = f.sig.ident.clone();
        let trait_ident = trait_of(&name);
        let (sig, attrs) = (&f.sig, &f.attrs);
        let body = eager_block(&f.block, &pinned);
        let lazy_body = lazy_block(&f.block, &pinned);
        let not_a_kind =
            format!("`{{{KIND}}}` is not a kind of tensor: `{type_name}::{name}` takes `&Tensor` or `&LazyTensor`");
        let not_dereferenced = NOT_DEREFERENCED;
        extra.extend(quote! {
            #[doc(hidden)]
            #[allow(non_camel_case_types)]
            #[diagnostic::on_unimplemented(message = #not_a_kind, note = #not_dereferenced)]
            pub trait #trait_ident<#k: ::toma::lazy::nn::RecurrentState> {
                #decl;
            }
            impl #impl_generics #trait_ident<::tch::Tensor> for #self_ty #where_clause {
                #(#attrs)*
                #sig #body
            }
            impl #impl_generics #trait_ident<::toma::lazy::LazyTensor> for #self_ty #where_clause {
                #(#attrs)*
                #lazy_sig #lazy_body
            }
        });
        let mut wrapper = decl.clone();
        wrapper.generics.params.push(syn::parse_quote!(#k: ::toma::lazy::nn::RecurrentState));
        wrapper.generics.make_where_clause().predicates.push(syn::parse_quote!(Self: #trait_ident<#k>));
        let args = arg_names(&f.sig)?;
        let receiver = f.sig.receiver().map(|_| quote!(self,));
        if result_only(&f.sig) {
            // The caller's annotation picks the kind (`let loss: LazyTensor = m.loss(..)`), or
            // the lazy twin names it (`m.lazy_loss(..)`), as `lazy_zero_state` does.
            let mut twin_sig = lazy_sig.clone();
            twin_sig.ident = lazy_twin(&name);
            let vis = &f.vis;
            let doc = format!("`{name}` on lazy values, its kind named (`#[toma::lazy::module]`).");
            twins.push(syn::parse_quote! {
                #[doc = #doc]
                #vis #twin_sig {
                    <Self as #trait_ident<::toma::lazy::LazyTensor>>::#name(#receiver #(#args),*)
                }
            });
        }
        let mixed = mixed_wrapper(
            &f.sig,
            |joined| syn::parse_quote!(Self: #trait_ident<#joined>),
            |joined, args| quote!(<Self as #trait_ident<#joined>>::#name(#receiver #(#args),*)),
        );
        (f.sig, f.block) = match mixed {
            Some(mixed) => mixed,
            None => (wrapper, syn::parse_quote!({ <Self as #trait_ident<#k>>::#name(#receiver #(#args),*) })),
        };
    }
    if extra.is_empty() {
        return Err(syn::Error::new_spanned(
            &block.self_ty,
            "#[toma::lazy::module]: no method of this `impl` takes or gives a `Tensor` (or tch's `GRUState`, \
             `LSTMState`), so nothing is compiled for lazy values: name the tensor type `Tensor` in the \
             signatures (an alias of it is not seen), or remove the attribute",
        ));
    }
    block.items.extend(twins);
    Ok(quote!(#block #extra))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error_of(item: TokenStream2) -> String {
        expand(TokenStream2::new(), item).err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn an_impl_with_nothing_to_translate_is_named() {
        let e = error_of(quote!(impl Model { fn new() -> Self { Model } }));
        assert!(e.contains("no method of this `impl` takes or gives a `Tensor`"), "{e}");
        // An alias of the tensor type is not seen either, and the error says so.
        let e = error_of(quote!(impl Model { fn loss(&self, xs: &T) -> T { xs.relu() } }));
        assert!(e.contains("an alias of it is not seen"), "{e}");
    }

    #[test]
    fn a_method_whose_only_tensor_is_its_result_gets_a_lazy_twin() {
        let out =
            expand(TokenStream2::new(), quote!(impl Model { fn loss(&self, tokens: &[i64]) -> Tensor { todo!() } }))
                .expect("expands")
                .to_string();
        assert!(out.contains("fn lazy_loss"), "{out}");
        let out = expand(TokenStream2::new(), quote!(impl Model { fn loss(&self, xs: &Tensor) -> Tensor { todo!() } }))
            .expect("expands")
            .to_string();
        assert!(!out.contains("fn lazy_loss"), "a method that takes a tensor needs no twin: {out}");
    }

    #[test]
    fn later_tensor_arguments_take_either_kind() {
        let expanded = |item| expand(TokenStream2::new(), item).expect("expands").to_string().replace(' ', "");
        let out = expanded(quote!(
            fn style_loss(m1: &Tensor, m2: &tch::Tensor, weight: f64) -> Tensor {
                todo!()
            }
        ));
        // The first picks the kind; the second is converted to it.
        assert!(out.contains("m1:&__TomaTensor,m2:&__TomaArg0,weight:f64)->__TomaTensor"), "{out}");
        assert!(out.contains("__TomaTensor:::toma::lazy::ArgOf<__TomaArg0>"), "{out}");
        assert!(out.contains("(m1,&*<__TomaTensoras::toma::lazy::ArgOf<__TomaArg0>>::arg(m2,m1),weight)"), "{out}");
        let out =
            expanded(quote!(impl Model { fn loss(&self, x: &Tensor, y: &Tensor) -> (Tensor, Tensor) { todo!() } }));
        assert!(out.contains("Self:__TomaModel_loss<__TomaTensor>"), "{out}");
        assert!(out.contains("->(__TomaTensor,__TomaTensor)"), "{out}");
        // One tensor argument, or another that names tensors otherwise: one kind for all.
        for item in [
            quote!(
                fn f(x: &Tensor) -> Tensor {
                    todo!()
                }
            ),
            quote!(
                fn f(x: &Tensor, ys: &[Tensor]) -> Tensor {
                    todo!()
                }
            ),
        ] {
            assert!(!expanded(item).contains("ArgOf"));
        }
    }

    #[test]
    fn an_accumulator_that_takes_lazy_values_starts_lazy() {
        let out = expand(
            TokenStream2::new(),
            quote!(
                fn loss(xs: &[Tensor]) -> Tensor {
                    let mut loss = Tensor::from(0f32);
                    let mut pad = Tensor::zeros([2], (Kind::Float, Device::Cpu));
                    for x in xs {
                        loss = loss + x.relu();
                        pad = Tensor::ones([2], (Kind::Float, Device::Cpu));
                    }
                    loss + pad.sum(Kind::Float)
                }
            ),
        )
        .expect("expands")
        .to_string()
        .replace(' ', "");
        // Lazily only, and only the one that takes lazy values.
        assert_eq!(out.matches("::toma::lazy::IntoLazy::into_lazy(&(Tensor::from(0f32)))").count(), 1, "{out}");
        assert!(!out.contains("into_lazy(&(Tensor::zeros"), "{out}");
    }

    #[test]
    fn an_input_that_starts_from_a_field_takes_either_branch() {
        let out = expand(
            TokenStream2::new(),
            quote!(impl M { fn f(&self, t: &Tensor, greedy: bool) -> Tensor {
                let mut prev = self.start.shallow_clone();
                let target = Tensor::from_slice(&[1i64]);
                prev = if greedy { t.argmax(-1, false) } else { target };
                prev
            } }),
        )
        .expect("expands")
        .to_string()
        .replace(' ', "");
        assert!(out.contains("into_lazy(&(self.start.shallow_clone()))"), "{out}");
        assert!(out.contains("into_lazy(&(target))"), "{out}");
        assert_eq!(out.matches("into_lazy(&(self.start").count(), 1, "the Tensor body is as written: {out}");
    }

    #[test]
    fn like_methods_called_by_their_path_take_their_arguments_kind() {
        let out = expand(
            TokenStream2::new(),
            quote!(
                fn noisy(xs: &Tensor) -> Tensor {
                    let eps: Tensor = Tensor::randn_like(xs);
                    let pad: Tensor = Tensor::zeros_like(&Tensor::zeros([2], (Kind::Float, Device::Cpu)));
                    xs + eps * Tensor::full_like(xs, 0.1) + pad.sum(Kind::Float)
                }
            ),
        )
        .expect("expands")
        .to_string()
        .replace(' ', "");
        // Lazily, method calls, the annotation of the activation's noise lazy; the constant's
        // stays tch's. The eager body is as written.
        assert_eq!(out.matches("(xs).randn_like()").count(), 1, "{out}");
        assert_eq!(out.matches("(xs).full_like(0.1)").count(), 1, "{out}");
        assert_eq!(out.matches("Tensor::randn_like(xs)").count(), 1, "{out}");
        assert!(out.contains("leteps:::toma::lazy::LazyTensor=(xs).randn_like()"), "{out}");
        assert!(out.contains("letpad:Tensor=(&Tensor::zeros("), "{out}");
    }

    #[test]
    fn the_eager_body_unwraps_and_calls_its_own_kind() {
        let out = expand(
            TokenStream2::new(),
            quote!(impl Model {
                fn loss(&self, t: &[i64]) -> Tensor { lazy(&Tensor::from_slice(t), None).relu() }
                fn twice(&self, t: &[i64]) -> Tensor { self.loss(t) * 2.0 }
            }),
        )
        .expect("expands")
        .to_string()
        .replace(' ', "");
        assert!(out.contains("::toma::lazy::eager_wrap(&Tensor::from_slice(t),None)"), "{out}");
        assert!(out.contains("<Selfas__TomaModel_loss<::tch::Tensor>>::loss(self,t)"), "{out}");
        assert!(out.contains("<Selfas__TomaModel_loss<::toma::lazy::LazyTensor>>::loss(self,t)"), "{out}");
    }
}
