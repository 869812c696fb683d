//! `#[tensor_methods(Trait, "doc")]`, internal to toma: on an `impl LazyTensor` block of one op
//! family, every `pub fn f_op(..) -> Result<T, LazyError>` is written once and gets
//! - its panicking twin `op` on `LazyTensor` (as tch pairs `op` with `f_op`);
//! - both forms in the family's trait `Trait`, implemented for tch's `Tensor` (tch's own method
//!   of the same name) and for `LazyTensor` (the method above), so that a model written over
//!   `T: TensorOps` calls it on either.
//!
//! Per method: `#[lazy_only]` keeps it out of the trait (tch has no such method, or another
//! signature); `#[twin(name)]` names the twin another way, `#[no_twin]` writes none (one is
//! written by hand). Per parameter, a tensor operand (`impl IntoLazy`) is `&Self` in the trait,
//! an activation of the same kind, unless marked `#[fixed]`: then `&Tensor`, a parameter or
//! constant. Integer lists (`impl IntList`, `impl IntListOption`) are handed to tch as slices.
//!
//! A trait method also starts with its direct path: on a value computed at once (the eager
//! form of a `LazyTensor`, which toma's `nn::func` closures get on a `Tensor`) with operands
//! that are tensors or such values, it calls tch's method and records nothing.

use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::{
    Attribute, Expr, ExprLit, FnArg, GenericArgument, ImplItem, ImplItemFn, ItemImpl, Lit, Meta, Pat, PathArguments,
    ReturnType, Token, Type, TypeParamBound,
};

pub(crate) fn expand(args: TokenStream2, item: TokenStream2) -> syn::Result<TokenStream2> {
    let args = Punctuated::<Expr, Token![,]>::parse_terminated.parse2(args)?;
    let mut args = args.into_iter();
    let trait_name = match args.next() {
        Some(Expr::Path(p)) if p.path.get_ident().is_some() => p.path.get_ident().cloned().expect("checked"),
        other => {
            return Err(syn::Error::new(
                other.map_or(Span::call_site(), |e| syn::spanned::Spanned::span(&e)),
                "expected the trait's name",
            ))
        }
    };
    let trait_doc = match args.next() {
        Some(Expr::Lit(ExprLit { lit: Lit::Str(s), .. })) => s.value(),
        _ => return Err(syn::Error::new(Span::call_site(), "expected the trait's documentation, a string")),
    };
    let mut block: ItemImpl = syn::parse2(item)?;
    let existing: Vec<String> = block
        .items
        .iter()
        .filter_map(|i| match i {
            ImplItem::Fn(f) => Some(f.sig.ident.to_string()),
            _ => None,
        })
        .collect();

    let mut twins = Vec::new();
    let (mut decls, mut tch_impls, mut lazy_impls) = (Vec::new(), Vec::new(), Vec::new());
    for item in &mut block.items {
        let ImplItem::Fn(f) = item else { continue };
        let lazy_only = take_flag(&mut f.attrs, "lazy_only");
        let no_twin = take_flag(&mut f.attrs, "no_twin");
        let twin_name = take_twin(&mut f.attrs)?;
        let name = f.sig.ident.to_string();
        let fixed = take_fixed_params(f);
        if !matches!(f.vis, syn::Visibility::Public(_)) || !name.starts_with("f_") {
            continue;
        }
        let Some(ok) = ok_type(&f.sig.output) else { continue };
        let twin = twin_name.unwrap_or_else(|| format_ident!("{}", &name[2..]));
        let params = params(f)?;
        let has_self = f.sig.receiver().is_some();
        if !no_twin && !existing.contains(&twin.to_string()) {
            twins.push(twin_method(f, &twin, &ok, &params, has_self));
        }
        if lazy_only {
            continue;
        }
        if !has_self || !is_lazy_tensor(&ok) {
            return Err(syn::Error::new_spanned(
                &f.sig,
                "a trait method takes `&self` and returns `Result<LazyTensor, LazyError>`; mark it #[lazy_only]",
            ));
        }
        let (decl, tch_impl, lazy_impl) = trait_method(f, &twin, &params, &fixed);
        let eager = eager_path(f, &params);
        f.block.stmts.insert(0, syn::parse2(eager)?);
        decls.push(decl);
        tch_impls.push(tch_impl);
        lazy_impls.push(lazy_impl);
    }
    block.items.extend(twins.into_iter().map(ImplItem::Fn));
    Ok(quote! {
        #block

        #[doc = #trait_doc]
        pub trait #trait_name: crate::lazy::ops::Fallible {
            #(#decls)*
        }

        impl #trait_name for ::tch::Tensor {
            #(#tch_impls)*
        }

        impl #trait_name for crate::lazy::LazyTensor {
            #(#lazy_impls)*
        }
    })
}

/// Removes `#[name]` from `attrs`; whether it was there.
fn take_flag(attrs: &mut Vec<Attribute>, name: &str) -> bool {
    let before = attrs.len();
    attrs.retain(|a| !(a.path().is_ident(name) && matches!(a.meta, Meta::Path(_))));
    attrs.len() != before
}

/// Removes `#[twin(name)]`; the name.
fn take_twin(attrs: &mut Vec<Attribute>) -> syn::Result<Option<syn::Ident>> {
    let mut twin = None;
    let mut error = None;
    attrs.retain(|a| {
        if !a.path().is_ident("twin") {
            return true;
        }
        match a.parse_args::<syn::Ident>() {
            Ok(ident) => twin = Some(ident),
            Err(e) => error = Some(e),
        }
        false
    });
    match error {
        Some(e) => Err(e),
        None => Ok(twin),
    }
}

/// Removes `#[fixed]` from the parameters; their names.
fn take_fixed_params(f: &mut ImplItemFn) -> Vec<String> {
    let mut fixed = Vec::new();
    for input in &mut f.sig.inputs {
        if let FnArg::Typed(pt) = input {
            if take_flag(&mut pt.attrs, "fixed") {
                if let Pat::Ident(p) = &*pt.pat {
                    fixed.push(p.ident.to_string());
                }
            }
        }
    }
    fixed
}

/// `T` of a `Result<T, E>` return type.
fn ok_type(output: &ReturnType) -> Option<Type> {
    let ReturnType::Type(_, ty) = output else { return None };
    let Type::Path(p) = &**ty else { return None };
    let last = p.path.segments.last()?;
    if last.ident != "Result" {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else { return None };
    match args.args.first()? {
        GenericArgument::Type(t) => Some(t.clone()),
        _ => None,
    }
}

fn is_lazy_tensor(ty: &Type) -> bool {
    matches!(ty, Type::Path(p) if p.path.is_ident("LazyTensor"))
}

/// The typed parameters, by name.
fn params(f: &ImplItemFn) -> syn::Result<Vec<(syn::Ident, Type)>> {
    let mut out = Vec::new();
    for input in &f.sig.inputs {
        if let FnArg::Typed(pt) = input {
            let Pat::Ident(p) = &*pt.pat else {
                return Err(syn::Error::new_spanned(&pt.pat, "expected a plain parameter name"));
            };
            out.push((p.ident.clone(), (*pt.ty).clone()));
        }
    }
    Ok(out)
}

/// The doc attributes of `f`.
fn docs(f: &ImplItemFn) -> Vec<&Attribute> {
    f.attrs.iter().filter(|a| a.path().is_ident("doc")).collect()
}

/// The first paragraph of `f`'s documentation.
fn summary(f: &ImplItemFn) -> Vec<Attribute> {
    let mut out = Vec::new();
    for a in docs(f) {
        if let Meta::NameValue(nv) = &a.meta {
            if let Expr::Lit(ExprLit { lit: Lit::Str(s), .. }) = &nv.value {
                if s.value().trim().is_empty() {
                    break;
                }
            }
        }
        out.push(a.clone());
    }
    out
}

/// The panicking twin of `f` on `LazyTensor`.
fn twin_method(
    f: &ImplItemFn,
    twin: &syn::Ident,
    ok: &Type,
    params: &[(syn::Ident, Type)],
    has_self: bool,
) -> ImplItemFn {
    let f_name = &f.sig.ident;
    let inputs = &f.sig.inputs;
    let generics = &f.sig.generics;
    let names: Vec<_> = params.iter().map(|(n, _)| n).collect();
    let call = if has_self { quote!(self.#f_name(#(#names),*)) } else { quote!(Self::#f_name(#(#names),*)) };
    let doc = format!("Like [`{f_name}`](Self::{f_name}), panicking with its error.");
    syn::parse_quote! {
        #[doc = #doc]
        ///
        /// # Panics
        /// When the op cannot be recorded (the error's message says why), as tch's method does.
        #[track_caller]
        #[allow(clippy::too_many_arguments)]
        pub fn #twin #generics (#inputs) -> #ok {
            crate::lazy::error::OrPanic::or_panic(#call)
        }
    }
}

/// Whether `ty` is `impl Trait` with a bound whose last segment is `name`.
fn is_impl(ty: &Type, name: &str) -> bool {
    let Type::ImplTrait(t) = ty else { return false };
    t.bounds
        .iter()
        .any(|b| matches!(b, TypeParamBound::Trait(tb) if tb.path.segments.last().is_some_and(|s| s.ident == name)))
}

/// `Option<X>`: `X`.
fn option_of(ty: &Type) -> Option<&Type> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    if last.ident != "Option" {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else { return None };
    match args.args.first()? {
        GenericArgument::Type(t) => Some(t),
        _ => None,
    }
}

/// The trait's declaration of `f` and its two implementations.
fn trait_method(
    f: &ImplItemFn,
    twin: &syn::Ident,
    params: &[(syn::Ident, Type)],
    fixed: &[String],
) -> (TokenStream2, TokenStream2, TokenStream2) {
    let f_name = &f.sig.ident;
    let summary = summary(f);
    let mut trait_params = Vec::new();
    let mut to_tch = Vec::new();
    let names: Vec<_> = params.iter().map(|(n, _)| n).collect();
    for (name, ty) in params {
        let operand = if fixed.contains(&name.to_string()) { quote!(&::tch::Tensor) } else { quote!(&Self) };
        let (trait_ty, arg) = if is_impl(ty, "IntoLazy") {
            (operand, quote!(#name))
        } else if option_of(ty).is_some_and(|inner| is_impl(inner, "IntoLazy")) {
            (quote!(Option<#operand>), quote!(#name))
        } else if is_impl(ty, "IntList") {
            (quote!(#ty), quote!(#name.as_slice()))
        } else if is_impl(ty, "IntListOption") {
            (quote!(#ty), quote!(#name.as_option()))
        } else {
            (quote!(#ty), quote!(#name))
        };
        trait_params.push(quote!(#name: #trait_ty));
        to_tch.push(arg);
    }
    let doc = format!("Like [`{f_name}`](Self::{f_name}), panicking with its error.");
    let decl = quote! {
        #(#summary)*
        ///
        /// # Errors
        /// The op's error: libtorch's, or what recording found.
        #[allow(clippy::too_many_arguments)]
        fn #f_name(&self, #(#trait_params),*) -> Result<Self, Self::Error>;
        #[doc = #doc]
        #[track_caller]
        #[allow(clippy::too_many_arguments)]
        fn #twin(&self, #(#trait_params),*) -> Self {
            crate::lazy::error::OrPanic::or_panic(self.#f_name(#(#names),*))
        }
    };
    let tch_impl = quote! {
        #[inline]
        #[allow(clippy::too_many_arguments)]
        fn #f_name(&self, #(#trait_params),*) -> Result<Self, ::tch::TchError> {
            ::tch::Tensor::#f_name(self, #(#to_tch),*)
        }
    };
    let lazy_impl = quote! {
        #[allow(clippy::too_many_arguments)]
        fn #f_name(&self, #(#trait_params),*) -> Result<Self, crate::lazy::LazyError> {
            crate::lazy::LazyTensor::#f_name(self, #(#names),*)
        }
    };
    (decl, tch_impl, lazy_impl)
}

/// The statement a trait method starts with: on a value computed at once, tch's own method.
fn eager_path(f: &ImplItemFn, params: &[(syn::Ident, Type)]) -> TokenStream2 {
    let f_name = &f.sig.ident;
    let op = f_name.to_string()[2..].to_string();
    let (mut pats, mut exprs, mut args) = (Vec::new(), Vec::new(), Vec::new());
    for (name, ty) in params {
        let value = format_ident!("__eager_{}", name);
        if is_impl(ty, "IntoLazy") {
            pats.push(quote!(Some(#value)));
            exprs.push(quote!(crate::lazy::ops::record::IntoLazy::eager_operand(&#name)));
            args.push(quote!(#value));
        } else if option_of(ty).is_some_and(|inner| is_impl(inner, "IntoLazy")) {
            pats.push(quote!(Some(#value)));
            exprs.push(quote!(crate::lazy::ops::record::eager_option(&#name)));
            args.push(quote!(#value));
        } else if is_impl(ty, "IntList") {
            args.push(quote!(#name.as_slice()));
        } else if is_impl(ty, "IntListOption") {
            args.push(quote!(#name.as_option()));
        } else {
            args.push(quote!(#name));
        }
    }
    let call = quote! {
        return ::tch::Tensor::#f_name(__eager_self, #(#args),*)
            .map(crate::lazy::LazyTensor::from_eager)
            .map_err(crate::lazy::ops::eager_err(#op));
    };
    let body = if pats.is_empty() {
        call
    } else {
        quote! {
            #[allow(unused_parens)]
            if let (#(#pats),*) = (#(#exprs),*) {
                #call
            }
        }
    };
    quote! {
        if let Some(__eager_self) = self.eager_value() {
            #body
        }
    }
}
